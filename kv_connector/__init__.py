"""Layer 3: the vLLM v1 KV connector built on the lookup buffer. Arrives with the connector issue."""
