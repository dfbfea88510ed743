"""The connector's worker side (vLLM's Worker process, one per TP rank): the peer links, saves, lookups and loads
(pull or push), on plain tensors; it imports nothing of the scheduler side."""
