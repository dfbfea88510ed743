"""KV-cache mechanics, shared by the worker's transfers: the cache's layout and the descriptor entries carry, which
KV heads a TP rank holds, block copies in and out of the paged cache, pinned host memory and staging streams."""
