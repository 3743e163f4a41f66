"""Export a namespace's blocks to a file and import them into a daemon (warming a new node).

Primitives: `export_namespace`, `import_namespace`, `read_header`. Both move blocks in
batches over the ordinary RPCs: `ListBlocks` (parents first), verified `Fetch`es, and
chained `Put`s with `parent_hash`, so the importing daemon checksums and publishes each
batch exactly like any other put.

File format (version 1), all integers little-endian:

    magic     b"KVSTORE-EXPORT\\n" then b"v1\\n"
    header    u32 length, then that many bytes of UTF-8 JSON:
              {"namespace_id": hex, "layout": {KVLayout fields}, "block_bytes": int}
    records   b"B", hash (16 bytes), parent hash (16 bytes; zeros: none),
              u64 xxh3-64 of the payload, payload (block_bytes bytes)
    end       b"E", u64 number of records

The import refuses a file whose layout does not hash to its namespace id, a record whose
payload does not match its checksum, and a file without the end record (truncated).
Blocks imported before a bad record are valid (each was verified) and stay.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import BinaryIO

from kvstore.checksum import checksum
from kvstore.client.admin import AdminClient
from kvstore.convert import layout_from_proto, layout_to_proto
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVLayout

MAGIC = b"KVSTORE-EXPORT\nv1\n"
NO_PARENT = b"\0" * HASH_BYTES
RECORD = struct.Struct(f"<c{HASH_BYTES}s{HASH_BYTES}sQ")
END = struct.Struct("<cQ")
# Blocks per Fetch or Put: bounded by bytes so a batch stays well under message caps and memory.
BATCH_BYTES = 8 << 20
MAX_HEADER_BYTES = 1 << 20

Progress = Callable[[int], None]  # called with the number of blocks just done


@dataclass(frozen=True, slots=True)
class ExportResult:
    blocks: int
    exported_bytes: int
    skipped: int  # listed but gone (evicted or deleted) before they could be read


@dataclass(frozen=True, slots=True)
class ImportResult:
    blocks: int
    stored: int
    existing: int


@dataclass(frozen=True, slots=True)
class ExportHeader:
    namespace_id: bytes
    layout: KVLayout
    block_bytes: int


LAYOUT_FIELDS = tuple(f.name for f in fields(KVLayout) if f.init)


def _batch_count(block_bytes: int) -> int:
    return max(1, BATCH_BYTES // max(1, block_bytes))


def export_namespace(admin: AdminClient, namespace_id: bytes, out: BinaryIO, progress: Progress | None = None,
                     total: Callable[[int], None] | None = None) -> ExportResult:
    """Write every block of `namespace_id` to `out`; `total` is told the block count first."""
    known = {n.namespace_id: n for n in admin.list_namespaces()}
    if namespace_id not in known:
        raise InvalidArgument(f"namespace {namespace_id.hex()} is not known to the daemon; see `kvstore ls`")
    ns = known[namespace_id]
    layout = layout_from_proto(ns.layout)
    if layout.groups:
        # A grouped block is parts that only some prefix ends have: not one payload per block.
        raise InvalidArgument(f"namespace {namespace_id.hex()} has KV groups ({', '.join(g.name for g in layout.groups)}); "
                              "export does not carry grouped namespaces yet")
    refs = admin.list_blocks(namespace_id)
    if total is not None:
        total(len(refs))
    # The file names the public namespace id (the one its layout hashes to), not the id
    # the exporting tenant's salt files it under: an import files the blocks under the
    # importing caller's tenant, whoever exported them.
    header = json.dumps({"namespace_id": layout.namespace_id.hex(), "layout": {k: v for k, v in asdict(layout).items()
                                                                        if k in LAYOUT_FIELDS},
                         "block_bytes": ns.block_bytes}).encode()
    out.write(MAGIC + struct.pack("<I", len(header)) + header)
    written = skipped = 0
    step = _batch_count(ns.block_bytes)
    i = 0
    while i < len(refs):
        batch = refs[i : i + step]
        datas = admin.fetch_blocks(namespace_id, [r.hash for r in batch])
        # A fetch returns the longest present prefix: `datas` may be shorter than `batch`.
        for ref, data in zip(batch, datas, strict=False):
            out.write(RECORD.pack(b"B", ref.hash, ref.parent_hash or NO_PARENT, checksum(data)))
            out.write(data)
        written += len(datas)
        i += len(datas)
        if len(datas) < len(batch):  # the next block went away meanwhile: skip it, go on
            skipped += 1
            i += 1
        if progress is not None:
            progress(len(datas) + (1 if len(datas) < len(batch) else 0))
    out.write(END.pack(b"E", written))
    return ExportResult(written, written * ns.block_bytes, skipped)


def read_header(src: BinaryIO) -> ExportHeader:
    if src.read(len(MAGIC)) != MAGIC:
        raise InvalidArgument("not a kvstore export file (bad magic); make one with `kvstore export`")
    (length,) = struct.unpack("<I", _read_exact(src, 4))
    if length > MAX_HEADER_BYTES:
        raise InvalidArgument(f"export header claims {length} bytes; the file is damaged")
    text = _read_exact(src, length)
    try:
        raw = json.loads(text)
    except RecursionError:
        raise InvalidArgument("export header is damaged: it nests too deeply to be a kvstore header") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise InvalidArgument(f"export header is damaged: {exc}") from None
    # Types are checked before use: a header from anything but `kvstore export` may hold anything.
    if not isinstance(raw, dict) or not isinstance(raw.get("namespace_id"), str) \
            or not isinstance(raw.get("layout"), dict) or type(raw.get("block_bytes")) is not int:
        raise InvalidArgument("export header is damaged: expected a JSON object with namespace_id (hex text), "
                              "layout (an object) and block_bytes (an integer)")
    try:
        layout = KVLayout(**{k: v for k, v in raw["layout"].items() if k in LAYOUT_FIELDS})
        header = ExportHeader(bytes.fromhex(raw["namespace_id"]), layout, raw["block_bytes"])
    except (InvalidArgument, ValueError, TypeError) as exc:  # TypeError: a layout field is missing
        raise InvalidArgument(f"export header is damaged: {exc}") from None
    if layout.namespace_id != header.namespace_id:
        raise FailedPrecondition(
            f"the file's layout hashes to namespace {layout.namespace_id.hex()}, not {header.namespace_id.hex()}; "
            "it was written by an incompatible kvstore version"
        )
    if layout.bytes_per_block != header.block_bytes:
        raise InvalidArgument(f"export header says {header.block_bytes} bytes per block, its layout "
                              f"{layout.bytes_per_block}; the file is damaged")
    return header


def _read_exact(src: BinaryIO, n: int) -> bytes:
    data = src.read(n)
    if len(data) != n:
        raise InvalidArgument("the export file ends early (truncated); export it again")
    return data


@dataclass(frozen=True, slots=True)
class _Record:
    block_hash: bytes
    parent_hash: bytes
    data: bytes


def _records(src: BinaryIO, header: ExportHeader) -> Iterator[_Record]:
    count = 0
    while True:
        tag = _read_exact(src, 1)
        if tag == b"E":
            (expected,) = struct.unpack("<Q", _read_exact(src, END.size - 1))
            if expected != count:
                raise InvalidArgument(f"the export file lists {expected} blocks but holds {count}; it is damaged")
            return
        if tag != b"B":
            raise InvalidArgument(f"unexpected record type {tag!r} after block {count}; the file is damaged")
        _, h, parent, csum = RECORD.unpack(tag + _read_exact(src, RECORD.size - 1))
        data = _read_exact(src, header.block_bytes)
        if checksum(data) != csum:
            raise InvalidArgument(f"block {count} ({h.hex()}) fails its checksum; the file is damaged. "
                                  f"Blocks before it were imported")
        count += 1
        yield _Record(h, b"" if parent == NO_PARENT else parent, data)


def import_namespace(admin: AdminClient, src: BinaryIO, progress: Progress | None = None) -> ImportResult:
    """Put every block of an export file into the daemon, in chained batches."""
    header = read_header(src)
    layout = layout_to_proto(header.layout)
    step = _batch_count(header.block_bytes)
    blocks = stored = existing = 0
    run: list[_Record] = []

    def flush() -> None:
        nonlocal stored, existing
        if not run:
            return
        resp = admin.put_chain(layout, [r.block_hash for r in run], run[0].parent_hash, [r.data for r in run])
        if list(resp.block_hashes) != [r.block_hash for r in run]:
            raise FailedPrecondition("the daemon stored these blocks under other hashes; is it a compatible version?")
        stored += resp.stored
        existing += resp.existing
        if progress is not None:
            progress(len(run))
        run.clear()

    try:
        for record in _records(src, header):
            blocks += 1
            if run and (record.parent_hash != run[-1].block_hash or len(run) >= step):
                flush()
            run.append(record)
    except InvalidArgument:
        flush()  # every record read so far verified: keep them, then report the damage
        raise
    flush()
    return ImportResult(blocks, stored, existing)


def estimate_blocks(path: str, header: ExportHeader, header_end: int) -> int:
    """How many records a file of this size holds (for a progress bar's total)."""
    return max(0, (os.stat(path).st_size - header_end - END.size) // (RECORD.size + header.block_bytes))
