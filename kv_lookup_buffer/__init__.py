"""Layer 2: the KV lookup buffer (insert / drop_select) over a KV pipe. Arrives with the SimpleBuffer issue."""
