"""Layer 4: the prefill/decode disaggregation proxy, an OpenAI-compatible HTTP front door.

Run (the entry point is ``proxy_server.py`` at the repository's root, or the ``mooncake-kv-proxy`` script)::

    python proxy_server.py --prefill http://P1:8100 [--prefill http://P2:8100 ...] \\
                           --decode http://D1:8200 [--decode http://D2:8200 ...] --host 127.0.0.1 --port 8000

Flow of ``POST /v1/completions`` and ``POST /v1/chat/completions``:

1. The body is parsed (invalid JSON or not an object -> 400). A request id is taken from ``X-Request-Id`` or
   generated; it and ``Authorization`` are forwarded to both upstreams, and the id is returned in the response.
2. The decode instance is chosen first (fewest outstanding requests, round robin on ties) and counted as busy
   from then on: in push mode the producer must know where the KV goes before it prefills.
3. Prefill: a copy of the request with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat), ``stream``
   false, no ``stream_options`` and the protocol's ``kv_transfer_params`` goes to the prefill instance chosen the
   same way and is awaited. An error status (4xx/5xx) is relayed to the client as is and ends the request.
4. Decode: the original request, with the protocol's ``kv_transfer_params`` in place of any of its own, goes to the chosen
   decode instance. A streaming answer (SSE) is relayed chunk by chunk as it arrives; any other answer as is.

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
- ``validate``: the request checked as vLLM would check it.
- ``errors``: ``ProxyError`` (a JSON error of the proxy's own) and ``RelayedError`` (an upstream's, as is).
- ``relay``: ``StreamRelay``, an upstream SSE answer relayed chunk by chunk.
- ``protocols``: ``ParamsProtocol`` and ``BootstrapProtocol``, what each request tells the instances.
- ``app``: ``Proxy`` (the state and the request flow) and ``create_app``.
- ``gate``: ``ClientGate``, the listening socket and who may hold a connection to it.
"""
