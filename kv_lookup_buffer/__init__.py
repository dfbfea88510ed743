"""Layer 2: the KV lookup buffer (insert on the producer, drop_select on the consumer) over a KV pipe."""

from kv_lookup_buffer.base import AnswerAbandoned, BufferFull, KVLookupBufferBase
from kv_lookup_buffer.simple_buffer import BufferClosed, SimpleBuffer

__all__ = ["AnswerAbandoned", "BufferClosed", "BufferFull", "KVLookupBufferBase", "SimpleBuffer"]
