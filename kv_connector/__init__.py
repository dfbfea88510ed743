"""Layer 3: the vLLM v1 KV connector (``MooncakeConnector``) built on the lookup buffer.

Import ``kv_connector.mooncake_connector`` (what vLLM does): this package itself imports nothing heavy.

Only the glue imports vLLM: ``connector.py`` (the facade vLLM creates), the scheduler side
(``scheduler_producer.py``, ``scheduler_consumer.py``), ``vllm_glue.py`` (a worker's description read off vLLM's
objects) and ``metrics.py`` (vLLM's stats and Prometheus classes). The worker's data path - ``worker.py``, pull and
push, loads, layouts, block copies, staging - takes plain tensors and a ``WorkerSpec`` and runs without vLLM; its
modules log under ``vllm.<module>`` so that inside vLLM its handlers and level apply.
"""
