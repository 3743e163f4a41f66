"""The peer transport's hand-written wire bytes parse as the messages they stand for."""

from __future__ import annotations

from conftest import SMALL_LAYOUT

from kvstore.cluster.transport import PeerCall, chunk_framer, lookup_request_bytes
from kvstore.convert import layout_to_proto
from kvstore.v1 import kvstore_pb2


def test_a_lookup_request_built_by_hand_is_the_message_protobuf_reads() -> None:
    call = PeerCall.of("alpha", layout_to_proto(SMALL_LAYOUT))
    for n in (0, 1, 7, 300):
        hashes = bytes(range(16)) * n
        req = kvstore_pb2.LookupRequest.FromString(lookup_request_bytes(call, hashes))
        assert req.keys.packed_hashes == hashes and req.keys.packed_reply and req.omit_hashes
        assert req.namespace.layout == layout_to_proto(SMALL_LAYOUT) and not req.lease_ms


def test_a_block_framed_for_a_put_is_its_chunks() -> None:
    data = memoryview(bytes(range(256)) * 10)
    framed = chunk_framer(1000)(3, data)
    assert b"".join(bytes(p) for p in framed.payload) == bytes(data)
    for message, payload in zip(framed.messages, framed.payload):
        req = kvstore_pb2.PutRequest.FromString(message)
        assert req.chunk.block == 3 and req.chunk.data == bytes(payload)
