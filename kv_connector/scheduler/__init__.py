"""The connector's scheduler side (vLLM's EngineCore process): what to save (producer) and what to look up and load
(consumer), in requests and block ids; it never touches KV and imports nothing of the worker side."""
