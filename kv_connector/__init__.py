"""Layer 3: the vLLM v1 KV connector (``MooncakeConnector``) built on the lookup buffer.

vLLM imports ``kv_connector.mooncake_connector`` (the facade it creates); this package itself imports nothing heavy.
``scheduler/`` decides what to save and load (requests and block ids), ``worker/`` moves the KV (links, pull, push,
lookups, loads) and ``cache/`` holds the KV-cache mechanics; the modules at the top are shared. Only the facade,
``scheduler/``, ``worker/vllm_spec.py`` and ``vllm_stats.py`` import vLLM (and ``config.py``'s start-up checks, when
called): the worker's data path takes plain tensors and a ``WorkerSpec``. Where each concern lives: docs/architecture.md.
"""
