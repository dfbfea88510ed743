"""Layer 4: the disaggregation proxy (prefill on a producer, then decode on a consumer).

Not implemented yet: it arrives with the proxy issue. Kept as a module so that the package layout is final.
"""

import sys


def main() -> None:
    sys.exit("proxy_server is not implemented yet (see the proxy issue)")


if __name__ == "__main__":
    main()
