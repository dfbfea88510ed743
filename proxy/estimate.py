"""Where a request gets its first token soonest: what work costs on each instance (``Costs``, learned from the answers
the proxy sees), what each instance has been sent and not yet answered (``Work``), and the choice between a remote
prefill and the whole request on the decode instance (``decide``; pure, given queues and costs).

The model, per instance (all of it learned online, nothing measured on one box and written down):

- a prefill of ``n`` tokens queued behind ``q`` tokens sent there before costs ``prefill(q + n)`` seconds to its
  first token, ``prefill`` a line ``base + per_token * tokens`` fitted to the prefills that instance answered (a
  prefill instance's prefill answers; a decode instance's requests it computed whole, by their first streamed token);
- a load of ``n`` tokens' KV into a decode instance costs ``load(n)`` to the first token, fitted to the requests it
  decoded after a remote prefill (their first streamed token);
- a decode step costs ``step`` (the mean gap between streamed chunks).

The options for a request whose prompt has ``u_d`` tokens the decode instance D lacks and ``u_p`` the prefill
instance P lacks:

- **remote**: ``prefill_P(q_P + u_p) + load_D(u_d)``;
- **local**: ``prefill_D(q_D + u_d)``, plus what it makes the others wait: each request decoding on D stalls while
  D prefills (``running_D * per_token_D * u_d``).

The cheaper one wins. Until the remote path's costs are learned (``MIN_SAMPLES`` prefill answers of P, as many
loads into D), the request is prefilled remotely: skipping is never guessed. A decode instance that has not yet
computed ``MIN_SAMPLES`` requests whole borrows P's prefill line (instances of one fleet usually run the same model
on the same hardware) until its own is learned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_SAMPLES = 3  # answers before a fit is trusted
DECAY = 0.1  # weight of each new sample in the fits (older ones fade: costs follow load and machine)
REMOTE, LOCAL = "remote", "local"


@dataclass
class LinearFit:
    """``seconds = base + per_token * tokens``, an exponentially weighted least-squares fit, kept non-negative: a
    slope that comes out negative (the time does not grow with the tokens, e.g. a wait for a decode slot dominates)
    gives a flat line at the mean, an intercept that comes out negative the line through the origin; while the
    samples' token counts barely differ, the line through the origin (a prefill's cost grows with its tokens)."""

    samples: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        if not (math.isfinite(tokens) and math.isfinite(seconds)) or tokens < 0 or seconds < 0:
            return
        keep = 1.0 - DECAY if self.samples else 0.0
        self.samples += 1
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + tokens
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + tokens * tokens
        self._xy = self._xy * keep + tokens * seconds

    @property
    def known(self) -> bool:
        return self.samples >= MIN_SAMPLES

    def line(self) -> tuple[float, float]:
        """(base, per_token) in seconds."""
        if not self._w:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > (0.05 * mx) ** 2 and var > 1.0:
            slope = (self._xy / self._w - mx * my) / var
            if slope <= 0:
                return my, 0.0
            base = my - slope * mx
            if base >= 0:
                return base, slope
            return 0.0, self._xy / self._xx  # through the origin
        if self._xx > 0:
            return 0.0, self._xy / self._xx
        return my, 0.0

    def predict(self, tokens: float) -> float:
        base, per_token = self.line()
        return base + per_token * max(tokens, 0.0)


@dataclass
class Costs:
    """What work costs on one instance (see the module docstring)."""

    prefill: LinearFit = field(default_factory=LinearFit)
    load: LinearFit = field(default_factory=LinearFit)
    step: float = 0.0  # seconds between two streamed chunks (exponentially weighted mean); 0 until seen
    steps: int = 0

    def observe_step(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self.step = seconds if not self.steps else self.step * (1 - DECAY) + seconds * DECAY
            self.steps += 1


@dataclass
class Work:
    """What the proxy sent an instance and has not seen the first token of (``queued`` requests, ``tokens`` to
    prefill), and the requests past their first token and not ended (``running``)."""

    queued: int = 0
    tokens: float = 0.0
    running: int = 0

    def add(self, tokens: float) -> None:
        """A request sent, ``tokens`` of it to prefill there."""
        self.queued += 1
        self.tokens += tokens

    def remove(self, tokens: float) -> None:
        """A request added with ``tokens`` is off the queue (its first token came, it failed or moved)."""
        self.queued -= 1
        self.tokens = max(self.tokens - tokens, 0.0)


@dataclass(frozen=True)
class Option:
    """One way to serve a request: the instances, the tokens each must compute or load, the time to its first token
    and the time it makes the others wait, in seconds."""

    kind: str
    first_token: float
    imposed: float = 0.0

    @property
    def cost(self) -> float:
        return self.first_token + self.imposed


@dataclass(frozen=True)
class Decision:
    """``remote`` (prefill on a prefill instance) or not, and why (a /metrics label): ``faster_remotely``,
    ``faster_locally``, ``not_learned`` (the remote path's costs are not known yet: remote), ``above_bound`` (more
    uncached tokens on D than the bound allows to compute there); the options compared, if any."""

    remote: bool
    reason: str
    local: Option | None = None
    via: Option | None = None


def remote_option(prefill: Costs, prefill_work: Work, uncached_p: float, decode: Costs, uncached_d: float) -> Option:
    return Option(REMOTE, prefill.prefill.predict(prefill_work.tokens + uncached_p) + decode.load.predict(uncached_d))


def local_option(decode: Costs, decode_work: Work, uncached_d: float, borrowed: LinearFit | None = None) -> Option:
    fit = borrowed or decode.prefill
    per_token = fit.line()[1]
    return Option(LOCAL, fit.predict(decode_work.tokens + uncached_d), decode_work.running * per_token * uncached_d)


def decide(prefill: Costs, prefill_work: Work, uncached_p: float, decode: Costs, decode_work: Work,
           uncached_d: float, bound: float = 0.0) -> Decision:
    """Remote prefill on P then decode on D, or the whole request on D (see the module docstring). ``bound``: from
    this many uncached tokens on D up, the request is never computed there (0: no bound)."""
    if bound and uncached_d >= bound:
        return Decision(True, "above_bound")
    if not (prefill.prefill.known and decode.load.known):
        return Decision(True, "not_learned")
    via = remote_option(prefill, prefill_work, uncached_p, decode, uncached_d)
    local = local_option(decode, decode_work, uncached_d, None if decode.prefill.known else prefill.prefill)
    if local.cost < via.cost:
        return Decision(False, "faster_locally", local, via)
    return Decision(True, "faster_remotely", local, via)
