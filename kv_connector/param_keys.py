"""The protocol facts the connector and the proxy share: ``kv_transfer_params`` keys and the endpoint info on /metrics.

Plain constants only: the proxy imports this module, so it must import nothing (no torch, no vLLM); see
``params.py`` for what each key means and how it is checked, ``vllm_stats.py`` for how the endpoint info is exported.
"""

# vLLM's disaggregation protocol: what a request asks of an instance
DO_REMOTE_DECODE = "do_remote_decode"  # prefill: keep the KV for another instance's decode
DO_REMOTE_PREFILL = "do_remote_prefill"  # decode: the KV comes from another instance's prefill

# a producer's answer (the decode request carries it on): where the KV waits
PIPE = "remote_pipe"  # the producer's pipe address per TP rank (rank i: element i)
ENGINE = "remote_engine_id"
TP_SIZE = "remote_tp_size"
REQUEST = "remote_request_id"
PROOF = "mooncake_proof"  # decode: the producer's proof of its params (with a secret)
PUSHED = "mooncake_pushed"  # push mode: the producer sends this prompt's KV (or a notice to pull it) to the consumer

# what the proxy puts on a decode it sends together with its prefill (push mode): no producer has answered yet
AWAIT_PUSH = "mooncake_await_push"  # with do_remote_prefill true: wait for whichever producer pushes this prompt

# what the proxy puts on a decode whose prefill it skipped because the KV pool holds the prompt (with
# do_remote_prefill true): no producer holds it, load what the pool holds and compute the rest
POOL_ONLY = "mooncake_pool_only"

# what the proxy adds to a prefill, push mode: where the KV goes
PUSH_TO = "mooncake_push_to"  # the consumer's pipe address per TP rank ([]: do not push)
PUSH_PROOF = "mooncake_push_proof"  # the consumer's proof of its push address (with a secret)

# a gauge (always 1) on each instance's /metrics whose labels say what a proxy needs to know about it
ENDPOINT_INFO = "vllm:mooncake_kv_endpoint_info"
KV_ROLE_LABEL = "kv_role"  # vLLM's kv_role: "kv_producer", "kv_consumer" or "kv_both"
TRANSFER_MODE_LABEL = "transfer_mode"  # "pull" or "push"
PIPES_LABEL = "pipes"  # pipe address per TP rank, comma separated
ENGINE_ID_LABEL = "kv_engine_id"
PUSH_PROOF_LABEL = "push_proof"  # a consumer's proof of its pipe addresses ("" without a secret)
POOL_LABEL = "kv_pool"  # the KV pool's master address ("" without a pool): instances naming one share their KV
