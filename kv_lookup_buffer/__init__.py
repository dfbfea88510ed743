"""Layer 2: the KV lookup buffer (insert on the producer, drop_select on the consumer) over a KV pipe, and push mode's
buffer (the producer streams an entry while it is computed; the consumer stages it).

Upper layers import from this package only (its API: docs/api.md)."""

from kv_lookup_buffer.base import AnswerAbandoned, BufferFull, KVLookupBufferBase, entry_key
from kv_lookup_buffer.push_buffer import PushBuffer, PushEnd
from kv_lookup_buffer.push_receiver import DROPPED, PULL, STAGED, PushArrivals, PushedEntry, PushReceiver
from kv_lookup_buffer.push_sender import PushSender
from kv_lookup_buffer.simple_buffer import BufferClosed, SimpleBuffer

__all__ = [
    "DROPPED", "PULL", "STAGED", "AnswerAbandoned", "BufferClosed", "BufferFull", "KVLookupBufferBase", "PushArrivals",
    "PushBuffer", "PushEnd", "PushReceiver", "PushSender", "PushedEntry", "SimpleBuffer", "entry_key",
]
