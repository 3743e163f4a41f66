"""The SSD log's record: its on-disk header, and the two forms a record takes in memory.

On disk a record is `RECORD` (little-endian: magic "KVR1", codec, itemsize, flags,
sequence number, key, parent hash, checksum of the uncompressed bytes, uncompressed
length, payload length, and a checksum of all of that), then the payload, then zero
padding to the I/O alignment (`align`).

In memory a record is a `Parsed` tuple (what `parse_header` reads back, and what a
region keeps for each live record), or a row of `REC_DTYPE` columns: the form a
snapshot stores (`SNAP_REC` is the same row as a struct) and recovered records keep
until their region changes (`parsed_of` turns rows back into tuples).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
import xxhash

MAGIC = b"KVR1"
# magic, codec, itemsize, flags, seq, key, parent hash, checksum, raw_len, payload_len
BODY = struct.Struct("<4sBBHQ32s16sQII")
RECORD = struct.Struct("<4sBBHQ32s16sQIIQ")  # BODY + header checksum
FLAG_HAS_PARENT = 1
# offset, size, seq, itemsize, has parent, key, parent hash, checksum, raw_len
SNAP_REC = struct.Struct("<QIQBB32s16sQI")
# The same record as numpy columns: a snapshot loads as one array, without a Python
# object per record, and recovered records stay in that form until a region changes.
REC_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("seq", "<u8"), ("itemsize", "u1"),
                      ("has_parent", "u1"), ("key", "V32"), ("parent", "V16"), ("checksum", "<u8"),
                      ("raw_len", "<u4")])
assert REC_DTYPE.itemsize == SNAP_REC.size


class Parsed(NamedTuple):
    offset: int
    size: int
    seq: int
    codec: int
    itemsize: int
    key: bytes
    parent: bytes | None
    checksum: int
    raw_len: int
    payload_len: int


def parse_header(buf: bytes | memoryview, offset: int, alignment: int) -> Parsed | None:
    if len(buf) < RECORD.size:
        return None
    fields = RECORD.unpack_from(buf, 0)
    magic, codec, itemsize, flags, seq, key, parent, csum, raw_len, payload_len, hcsum = fields
    if magic != MAGIC or xxhash.xxh3_64_intdigest(bytes(buf[: BODY.size])) != hcsum:
        return None
    size = align(RECORD.size + payload_len, alignment)
    parent_key = key[:16] + parent if flags & FLAG_HAS_PARENT else None
    return Parsed(offset, size, seq, codec, itemsize, key, parent_key, csum, raw_len, payload_len)


def align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def parsed_of(records: np.ndarray[Any, Any]) -> list[Parsed]:
    new, parsed_type = tuple.__new__, Parsed
    return [
        new(parsed_type, (offset, size, seq, 0, itemsize, key, key[:16] + parent if has_parent else None, csum,
                          raw_len, 0))
        for offset, size, seq, itemsize, has_parent, key, parent, csum, raw_len
        in SNAP_REC.iter_unpack(records.tobytes())
    ]
