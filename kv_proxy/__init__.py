"""Layer 4: the prefill/decode disaggregation proxy, an OpenAI-compatible HTTP front door.

Run (the entry point is ``proxy_server.py`` at the repository's root, or the ``mooncake-kv-proxy`` script)::

    python proxy_server.py --prefill http://P1:8100 [--prefill http://P2:8100 ...] \\
                           --decode http://D1:8200 [--decode http://D2:8200 ...] --host 127.0.0.1 --port 8000

Flow of ``POST /v1/completions`` and ``POST /v1/chat/completions``:

1. The body is parsed (invalid JSON or not an object -> 400). A request id is taken from ``X-Request-Id`` or
   generated; it and ``Authorization`` are forwarded to both upstreams, and the id is returned in the response.
2. The decode instance is chosen first (see Routing) and counted as busy from then on: in push mode the producer
   must know where the KV goes before it prefills.
3. Skip rule: whether the chosen decode instance computes the whole request itself (no remote prefill: it goes
   straight there with ``kv_transfer_params: {"do_remote_prefill": false, "do_remote_decode": false}``, and the
   connectors, this project's and vLLM's, load nothing). ``--routing prefix`` (the default): when the part of the
   prompt that instance does not hold is estimated below ``--skip-prefill-below N`` tokens (default 0: never; a
   fixed threshold chosen on one box lost 2.3-2.7x on a slower one: benchmarks/results/NOTES.md). ``--routing
   estimate``: when that is estimated to give the request its first token sooner, counting what it makes the
   requests decoding there wait (``estimate``, below); ``--skip-prefill-below`` then only bounds it (from N
   uncached tokens up, always remote). Logged at INFO with the numbers; counted per reason. Only the part the
   decode instance has *answered* counts as held (a request routed there a moment ago may still be loading its
   KV), and a text prompt is sized with the lowest characters per token of recent prompts (a character per token
   before any prefill answer has calibrated it: text of rare tokens can be ~1).
4. Prefill: a copy of the request with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat), ``stream``
   false, no ``stream_options`` and the protocol's ``kv_transfer_params`` goes to the prefill instance chosen the
   same way and is awaited. An error status (4xx/5xx) is relayed to the client as is and ends the request.
   Concurrent dispatch (``--dispatch concurrent``, the default): when the decode instance takes pushed KV (the
   prefill names it in ``mooncake_push_to``) the prefill is not awaited: it runs in the background and the decode
   goes out at once with ``{"do_remote_prefill": true, "mooncake_await_push": true}``, so the decode instance's
   HTTP, tokenization and scheduling overlap the prefill; it waits for the push (up to its ``push_wait``). A failed
   background prefill is logged and counted (``mooncake_proxy_background_prefill_failed_total``), never the
   client's: the decode instance computes the prompt itself. ``mooncake_proxy_dispatched_total{mode}`` counts both
   ways. ``--dispatch sequential`` always awaits the prefill.
5. Decode: the original request, with the protocol's ``kv_transfer_params`` in place of any of its own, goes to the chosen
   decode instance. A streaming answer (SSE) is relayed chunk by chunk as it arrives; any other answer as is. A
   decode that may load KV and fails before its first token with a server error (a KV load that broke, under vLLM's
   default ``kv_load_failure_policy``) is sent again, once, whole to a decode instance
   (``mooncake_proxy_decode_retries_total{reason}``); to tell, a stream's first event is read before relaying.

Routing (``Balancer.pick``, ``prefix_index``, ``routing``): the proxy has no tokenizer. It cuts each prompt into
chunks of 256 characters (a chat: its messages serialized in order, so a follow-up turn extends the previous turn's
prefix; a prompt of token ids: 64 ids) and chains their hashes, so one hash names a whole prefix. Each instance has
an index of the chunks routed to it. A request goes to the instance holding the longest prefix of its prompt unless
that instance is overloaded: it has more than ``--balance-slack`` (default 4) outstanding requests beyond the least
loaded instance of its role; otherwise (and when nobody holds a prefix) to the fewest outstanding requests, round
robin on ties. The default slack keeps affinity while the fleet is lightly loaded (where a prefix hit saves the most)
and bounds the skew under load to a few requests, small next to a vLLM batch. Tokens are estimated from characters
(3 per token until the prefill answers' ``usage.prompt_tokens`` calibrate it). Bounds: an instance's index holds at
most what its KV cache holds (``vllm:cache_config_info`` on its ``/metrics``, read in the background at most once per
``DISCOVERY_TTL``; 128k tokens if it does not say), least recently routed first out, and all indexes together at most
``--prefix-index-entries`` chunks (0: no prefix routing); a request's first 2048 chunks at most are hashed. An
instance that fails, is removed, or restarted (another process start time or cache size on its /metrics, another
push address or engine id) loses its index. ``/metrics`` counts ``mooncake_proxy_routed_total{role,rule}``
(rule ``prefix`` or ``balance``), ``mooncake_proxy_prefix_passed_over_total{role}``,
``mooncake_proxy_cached_prefix_tokens_total{role}`` (estimated), ``mooncake_proxy_prefill_skipped_total`` and
the index size ``mooncake_proxy_prefix_index_entries{role}``.

``--routing estimate`` (``estimate``, ``routing``): the proxy learns, from the answers it relays, what work costs on
each instance - a prefill of n tokens (seconds to the prefill instance's answer, or to the first streamed token of
a request a decode instance computed whole, against the tokens queued there before it plus its own), a load into a
decode instance (seconds from the later of the decode request and the prefill's answer to its first streamed
token), and a decode step (the gap between streamed chunks) - as lines fitted online, recent answers weighing
most. It knows what each instance has queued (what it sent and has not seen the first token of) and how many
requests are decoding there. A prefill instance is then chosen by the estimated end of the prompt's prefill there
(queued tokens plus the part of the prompt it does not hold: a cached prefix counts as saved work, not as a
preference), a decode instance by the better of its two options (remote prefill then a load of what it lacks, or
the whole request there plus the stall it causes its decoding requests), and the skip by comparing the two.
Until the remote path's costs are known (3 answers each) requests are prefilled remotely and the prefix rule
chooses. With ``--decode-on-prefill`` a third option competes: the whole request on the chosen prefill instance
(its first token there plus the stall it causes, and its decode there: its ``max_tokens`` times that instance's
learned step, against the same on the decode instance), sent with params that keep nothing for a consumer; a
saturated decode instance decodes slowly, so requests go to the prefill instance until its own steps grow; if no
prefill instance can take it, it goes whole to a decode instance. ``/metrics``:
``mooncake_proxy_route_decisions_total{choice,reason}`` (remote, local or on_prefill; reasons never,
below_threshold, not_below_threshold, unsized, not_learned, faster_locally, faster_remotely, faster_on_prefill,
above_bound),
``mooncake_proxy_estimated_cost_seconds{role,instance,cost}`` and ``mooncake_proxy_routed_total{rule="estimate"}``.

Admin (``admin``; only with ``--admin-token`` or ``MOONCAKE_PROXY_ADMIN_TOKEN``, else 404): ``/admin/instances`` on the
proxy's own port, with ``Authorization: Bearer <token>`` (missing -> 401, wrong -> 403): ``GET`` lists the instances
(with their URLs: only here), ``POST {"role", "url"}`` adds one, ``DELETE {"role", "url"}`` removes one (its requests
in flight finish; the last instance of a role cannot be removed: 409). Malformed bodies -> 400.

Protocols (``--protocol``):

- ``params`` (default; this project's MooncakeConnector, and any connector that answers vLLM's disaggregation
  protocol the same way, e.g. NixlConnector): the prefill asks ``{"do_remote_decode": true}``; its answer's
  ``kv_transfer_params`` (where the KV waits: any producer can serve any consumer) go on the decode request. A decode
  instance running our connector in push mode says so on its ``/metrics`` (``vllm:mooncake_kv_endpoint_info``, read
  once per ``DISCOVERY_TTL``): its pipe addresses then go on the prefill as ``mooncake_push_to``.
- ``bootstrap`` (vLLM's built-in MooncakeConnector): both requests carry one ``transfer_id``; the decode request
  also names the prefill instance's bootstrap server (``--bootstrap``, one per ``--prefill`` in the same order;
  default ``http://<prefill host>:8998``) and its engine id, read from that server's ``/query``.

Before anything goes upstream the request is checked as vLLM would check it (``prompt`` or ``messages``,
``max_tokens``, ``max_completion_tokens``, ``n``, ``model``, ``stream`` read as vLLM reads a boolean, e.g. "true"):
a request vLLM would refuse gets a 400 here, not after a prefill whose KV would then wait for nobody.

Timeouts: ``--connect-timeout`` (10 s) to reach an instance; ``--timeout`` (300 s) for a whole prefill or
non-streaming decode, and for the gap between two chunks of a stream (a stream may last as long as it produces).

An instance that cannot be reached or times out is skipped for ``--cooldown`` seconds (unless every instance of
its role is cooling down); a request that could not even connect is retried on another instance of the same
role. Unreachable -> 502, timed out (``--timeout``) -> 504, both with a JSON error naming the stage (``prefill``
or ``decode``). A client that disconnects cancels its upstream requests (their connections are closed).

``GET /health`` probes every upstream's ``/health`` (200 if at least one prefill and one decode instance are
healthy, else 503, with a per-instance report); ``GET /v1/models`` is passed through from a decode instance;
``GET /metrics`` is the proxy's own Prometheus text.

A client's own ``kv_transfer_params`` are dropped (and counted on /metrics): only the proxy says where KV comes from
and goes to.

One ``aiohttp.ClientSession`` (with a bounded connection pool) is created when serving starts and closed at
shutdown. ``create_app(config)`` builds the Quart app (used by ``main()`` and the tests); it is served by
Hypercorn behind a ``ClientGate``.

Modules (this package imports none of them itself, nor anything heavy: no torch, no vLLM):

- ``config``: ``ProxyConfig`` (the options, validated), ``parse_args``, upstream URL normalization.
- ``balancer``: ``Upstream`` (one instance and its bookkeeping) and ``Balancer`` (``pick``: which instance next).
- ``prefix_index``: prompts as chained chunk hashes, the per-instance LRU index, token estimates, cache sizes.
- ``discovery``: ``Discovery``, what each instance says about itself (its /metrics: ``InstanceInfo``; a bootstrap
  server's engine id), asked over the client session and kept per topic for ``DISCOVERY_TTL``.
- ``routing``: ``Router``, the choices counted and bounded, the skip rule.
- ``admin``: ``/admin/instances`` (given the config and the router).
- ``validate``: the request checked as vLLM would check it.
- ``errors``: ``ProxyError`` (a JSON error of the proxy's own) and ``RelayedError`` (an upstream's, as is).
- ``relay``: ``StreamRelay``, an upstream SSE answer relayed chunk by chunk.
- ``protocols``: ``ParamsProtocol`` and ``BootstrapProtocol``, what each request tells the instances.
- ``app``: ``Proxy`` (the state and the request flow) and ``create_app``.
- ``gate``: ``ClientGate``, the listening socket and who may hold a connection to it.

Imports run one way: ``app`` imports ``admin``, ``routing`` and ``protocols`` (``admin`` also ``routing``); those
import ``discovery``, which imports ``balancer`` and ``prefix_index``; none of them imports ``app``.
"""
