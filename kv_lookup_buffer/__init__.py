"""Layer 2: the KV lookup buffer (insert on the producer, drop_select on the consumer) over a KV pipe, push mode's
buffer (the producer streams an entry while it is computed; the consumer stages it), and the KV pool's buffer over
Mooncake Store (every instance puts and gets blocks by content).

Upper layers import from this package only (its API: docs/api.md)."""

from kv_lookup_buffer.base import AnswerAbandoned, BufferFull, KVLookupBufferBase, KVStoreBufferBase, entry_key
from kv_lookup_buffer.mooncake_store import TAG, Fetched, MooncakeStore, StoreError, StoreTimeout, block_keys
from kv_lookup_buffer.push_buffer import PushBuffer, PushEnd
from kv_lookup_buffer.push_receiver import DROPPED, PULL, STAGED, PushArrivals, PushedEntry, PushReceiver
from kv_lookup_buffer.push_sender import PushSender
from kv_lookup_buffer.simple_buffer import BufferClosed, SimpleBuffer
from kv_lookup_buffer.store_config import StoreConfig

__all__ = [
    "DROPPED", "PULL", "STAGED", "TAG", "AnswerAbandoned", "BufferClosed", "BufferFull", "KVLookupBufferBase",
    "Fetched", "KVStoreBufferBase", "MooncakeStore", "PushArrivals", "PushBuffer", "PushEnd", "PushReceiver", "PushSender",
    "PushedEntry", "SimpleBuffer", "StoreConfig", "StoreError", "StoreTimeout", "block_keys", "entry_key",
]
