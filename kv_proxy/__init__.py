"""Layer 4: the prefill/decode disaggregation proxy, an OpenAI-compatible HTTP front door.

Each completion's prompt goes to a prefill instance and the request to a decode instance, each told where the KV
goes; ``proxy_server.py`` (or the ``mooncake-kv-proxy`` script) runs it. docs/proxy.md tells what it does, its
options and its modules. Importing the package loads none of its modules, nor anything heavy (no torch, no vLLM).
"""
