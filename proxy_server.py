"""Layer 4: the prefill/decode disaggregation proxy, an OpenAI-compatible HTTP front door (the ``kv_proxy`` package).

Run::

    python proxy_server.py --prefill http://P1:8100 [--prefill http://P2:8100 ...] \\
                           --decode http://D1:8200 [--decode http://D2:8200 ...] --host 127.0.0.1 --port 8000

``python proxy_server.py --help`` lists the options; docs/proxy.md tells what it does.
"""

from __future__ import annotations

import asyncio
import logging

from kv_proxy.app import create_app
from kv_proxy.config import parse_args
from kv_proxy.gate import ClientGate, fit_to_file_limit

log = logging.getLogger("proxy_server")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, bind the configured host and port, and serve until SIGINT/SIGTERM."""
    config = fit_to_file_limit(parse_args(argv))
    gate = ClientGate(config)
    log.info("listening on http://%s:%d", config.host, gate.port)
    asyncio.run(gate.serve(create_app(config)))


if __name__ == "__main__":
    main()
