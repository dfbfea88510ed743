"""Layer 3: the vLLM v1 KV connector (``MooncakeConnector``) built on the lookup buffer.

Import ``kv_connector.mooncake_connector`` (what vLLM does): this package itself imports nothing heavy.
"""
