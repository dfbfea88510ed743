"""Where a request gets its first token soonest (``--routing estimate``): what work costs on each instance (``Costs``,
learned from the answers the proxy sees), what each instance has been sent and not yet answered (``Work``), and the
choice among a remote prefill, the whole request on the decode instance, or on a prefill instance (``decide``; pure,
given queues and costs). The model: docs/proxy.md#routing-estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_SAMPLES = 3  # answers before a fit is trusted
DECAY = 0.1  # weight of each new sample in the fits (older ones fade: costs follow load and machine)
REMOTE, LOCAL, ON_PREFILL = "remote", "local", "on_prefill"


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
    """What work costs on one instance (docs/proxy.md#routing-estimate)."""

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
    """One way to serve a request: the time to its first token, the time it makes the others wait, and (the whole
    request on a prefill instance) how much longer its decode takes there than on the decode instance, in seconds."""

    kind: str
    first_token: float
    imposed: float = 0.0
    decode: float = 0.0  # its decode's time here less on the decode instance (only where they differ)

    @property
    def cost(self) -> float:
        return self.first_token + self.imposed + self.decode


@dataclass(frozen=True)
class Decision:
    """Where the request goes: ``remote`` (prefill on a prefill instance, decode on the decode instance), ``local``
    (whole on the decode instance) or ``on_prefill`` (whole on the prefill instance); why (a /metrics label):
    ``faster_remotely``, ``faster_locally``, ``faster_on_prefill``, ``not_learned`` (the remote path's costs are not
    known yet: remote), ``above_bound`` (more uncached tokens on D than the bound allows to compute there); the
    options compared, if any."""

    where: str
    reason: str
    local: Option | None = None
    via: Option | None = None
    on_prefill: Option | None = None


def whole_option(kind: str, costs: Costs, work: Work, uncached: float, borrowed: LinearFit | None = None) -> Option:
    """The whole request on one instance: its prefill behind what is queued there, and the wait it imposes on the
    requests decoding there (``borrowed``: the prefill line to use while the instance's own is not learned)."""
    fit = borrowed or costs.prefill
    per_token = fit.line()[1]
    return Option(kind, fit.predict(work.tokens + uncached), work.running * per_token * uncached)


def remote_option(prefill: Costs, prefill_work: Work, uncached_p: float, decode: Costs, uncached_d: float) -> Option:
    return Option(REMOTE, prefill.prefill.predict(prefill_work.tokens + uncached_p) + decode.load.predict(uncached_d),
                  prefill_work.running * prefill.prefill.line()[1] * uncached_p)


def local_option(decode: Costs, decode_work: Work, uncached_d: float, borrowed: LinearFit | None = None) -> Option:
    return whole_option(LOCAL, decode, decode_work, uncached_d, borrowed)


def decode_steps(prefill: Costs, decode: Costs, output_tokens: float | None) -> tuple[float, float] | None:
    """The decode's time on P and on D (``out * step``), or None when it cannot be told (no output length, or no
    step learned on D); P borrows D's step until it has its own."""
    if not output_tokens or output_tokens <= 0 or decode.steps < MIN_SAMPLES:
        return None
    step_p = prefill.step if prefill.steps >= MIN_SAMPLES else decode.step
    return output_tokens * step_p, output_tokens * decode.step


def decide(prefill: Costs, prefill_work: Work, uncached_p: float, decode: Costs, decode_work: Work,
           uncached_d: float, bound: float = 0.0, on_prefill: bool = False,
           output_tokens: float | None = None, loaded_d: float | None = None) -> Decision:
    """Remote prefill on P then decode on D, or the whole request on D, or (``on_prefill``) the whole request on P
    (docs/proxy.md#routing-estimate). ``bound``: from this many uncached tokens on D up, the request is never computed
    there (0: no bound). ``loaded_d``: the tokens D loads after a remote prefill, if not ``uncached_d`` (a KV pool
    member computes only what its pool lacks, but loads all it lacks itself, from the producer or the pool)."""
    if bound and uncached_d >= bound and not on_prefill:
        return Decision(REMOTE, "above_bound")
    if not (prefill.prefill.known and decode.load.known):
        return Decision(REMOTE, "not_learned")
    via = remote_option(prefill, prefill_work, uncached_p, decode, uncached_d if loaded_d is None else loaded_d)
    local = None
    if not bound or uncached_d < bound:
        local = local_option(decode, decode_work, uncached_d, None if decode.prefill.known else prefill.prefill)
    steps = decode_steps(prefill, decode, output_tokens) if on_prefill else None
    whole_p = None
    if steps is not None:
        on_p, on_d = steps
        whole = whole_option(ON_PREFILL, prefill, prefill_work, uncached_p)
        # the decode's time counts only here, where the options decode on different instances
        whole_p = Option(ON_PREFILL, whole.first_token, whole.imposed, on_p - on_d)
    best = min((o for o in (via, local, whole_p) if o is not None), key=lambda o: o.cost)
    if best is whole_p:
        return Decision(ON_PREFILL, "faster_on_prefill", local, via, whole_p)
    if best is local:
        return Decision(LOCAL, "faster_locally", local, via, whole_p)
    return Decision(REMOTE, "faster_remotely" if local is not None or whole_p is not None else "above_bound", local,
                    via, whole_p)
