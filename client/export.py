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

A namespace with KV groups is written as version 2: magic b"KVSTORE-EXPORT\nv2\n", the
same header (its layout with its groups), and per block

    records   b"G", hash (16 bytes), parent hash (16 bytes; zeros: none), u32 mask of
              the groups that hold a part of it (bit g: group g), then for each of them
              in group order: u64 xxh3-64 of the part, the part (its group's size)

Each part is read as the exporting daemon verified it (`FetchRequest.group`), and the
import puts back exactly those parts, runs of a chain at a time, naming them
(`PutHeader.group_spans`), so a window's or a state's parts are where the puts that
made them had left them and every prefix end that hit before hits after. A block that
lacks a part its every-block groups need (went away during the export) is skipped.

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
from typing import Any, BinaryIO

from kvstore.checksum import checksum
from kvstore.client.admin import AdminClient
from kvstore.convert import layout_from_proto, layout_to_proto
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.groups import Rule, rule_of
from kvstore.hashing import HASH_BYTES
from kvstore.layout import KVGroup, KVLayout
from kvstore.v1 import admin_pb2

MAGIC = b"KVSTORE-EXPORT\nv1\n"
MAGIC_GROUPED = b"KVSTORE-EXPORT\nv2\n"
PARTS = struct.Struct(f"<c{HASH_BYTES}s{HASH_BYTES}sI")
PART_SUM = struct.Struct("<Q")
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
GROUP_FIELDS = tuple(f.name for f in fields(KVGroup) if f.init)


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
    refs = admin.list_blocks(namespace_id)
    if total is not None:
        total(len(refs))
    # The file names the public namespace id (the one its layout hashes to), not the id
    # the exporting tenant's salt files it under: an import files the blocks under the
    # importing caller's tenant, whoever exported them.
    header = json.dumps({"namespace_id": layout.namespace_id.hex(), "layout": _layout_fields(layout),
                         "block_bytes": ns.block_bytes}).encode()
    out.write((MAGIC_GROUPED if layout.groups else MAGIC) + struct.pack("<I", len(header)) + header)
    if layout.groups:
        return _export_parts(admin, namespace_id, layout, refs, out, progress)
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


def _layout_fields(layout: KVLayout) -> dict[str, object]:
    fields_ = {k: v for k, v in asdict(layout).items() if k in LAYOUT_FIELDS and k != "groups"}
    if layout.groups:
        fields_["groups"] = [{"name": g.name, "kind": g.kind.value, "dtype": g.dtype, "shape": list(g.shape),
                              "block_bytes": g.block_bytes, "window_tokens": g.window_tokens} for g in layout.groups]
    return fields_


def _layout_of(raw: dict[str, Any]) -> KVLayout:
    """The layout of a header's JSON (its values are checked by KVLayout and KVGroup)."""
    kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in LAYOUT_FIELDS}
    groups = kwargs.pop("groups", ())
    if not isinstance(groups, list | tuple) or not all(isinstance(g, dict) for g in groups):
        raise InvalidArgument("its layout's groups are not a list of objects")
    parsed = []
    for g in groups:
        group: dict[str, Any] = {k: v for k, v in g.items() if k in GROUP_FIELDS}
        if isinstance(group.get("shape"), list):
            group["shape"] = tuple(group["shape"])
        parsed.append(KVGroup(**group))
    return KVLayout(**kwargs, groups=tuple(parsed))


def _export_parts(admin: AdminClient, namespace_id: bytes, layout: KVLayout, refs: list[admin_pb2.BlockRef],
                  out: BinaryIO, progress: Progress | None) -> ExportResult:
    """The blocks of a grouped namespace, each with the parts it holds (format version 2)."""
    every = sum(1 << g for g, group in enumerate(layout.groups) if rule_of(group) is Rule.EVERY)
    written = skipped = nbytes = 0
    step = _batch_count(layout.bytes_per_block)
    for i in range(0, len(refs), step):
        batch = refs[i : i + step]
        parts: list[dict[int, bytes]] = [{} for _ in batch]
        for g, group in enumerate(layout.groups):
            todo = [k for k, ref in enumerate(batch) if ref.parts >> g & 1]
            while todo:  # the leading run that still holds a part; one that went away is skipped
                got = admin.fetch_parts(namespace_id, group.name, [batch[k].hash for k in todo])
                for k, data in zip(todo, got, strict=False):
                    parts[k][g] = data
                todo = todo[len(got) + 1 :]
        for ref, held in zip(batch, parts):
            mask = sum(1 << g for g in held)
            if mask & every != every:  # went away during the export (or never whole)
                skipped += 1
                continue
            out.write(PARTS.pack(b"G", ref.hash, ref.parent_hash or NO_PARENT, mask))
            for g in sorted(held):
                out.write(PART_SUM.pack(checksum(held[g])))
                out.write(held[g])
                nbytes += len(held[g])
            written += 1
        if progress is not None:
            progress(len(batch))
    out.write(END.pack(b"E", written))
    return ExportResult(written, nbytes, skipped)


def read_header(src: BinaryIO) -> ExportHeader:
    magic = src.read(len(MAGIC))
    if magic not in (MAGIC, MAGIC_GROUPED):
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
        layout = _layout_of(raw["layout"])
        header = ExportHeader(bytes.fromhex(raw["namespace_id"]), layout, raw["block_bytes"])
    except (InvalidArgument, ValueError, TypeError) as exc:  # TypeError: a layout field is missing
        raise InvalidArgument(f"export header is damaged: {exc}") from None
    if layout.namespace_id != header.namespace_id:
        raise FailedPrecondition(
            f"the file's layout hashes to namespace {layout.namespace_id.hex()}, not {header.namespace_id.hex()}; "
            "it was written by an incompatible kvstore version"
        )
    if bool(layout.groups) != (magic == MAGIC_GROUPED):
        raise InvalidArgument("export header is damaged: its version and its layout's groups disagree")
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


@dataclass(frozen=True, slots=True)
class _Parts:
    block_hash: bytes
    parent_hash: bytes
    parts: dict[int, bytes]


def _part_records(src: BinaryIO, header: ExportHeader) -> Iterator[_Parts]:
    groups = header.layout.groups
    every = sum(1 << g for g, group in enumerate(groups) if rule_of(group) is Rule.EVERY)
    count = 0
    while True:
        tag = _read_exact(src, 1)
        if tag == b"E":
            (expected,) = struct.unpack("<Q", _read_exact(src, END.size - 1))
            if expected != count:
                raise InvalidArgument(f"the export file lists {expected} blocks but holds {count}; it is damaged")
            return
        if tag != b"G":
            raise InvalidArgument(f"unexpected record type {tag!r} after block {count}; the file is damaged")
        _, h, parent, mask = PARTS.unpack(tag + _read_exact(src, PARTS.size - 1))
        if mask >> len(groups) or mask & every != every:
            raise InvalidArgument(f"block {count} ({h.hex()}) names parts its layout cannot have; the file is damaged")
        parts = {}
        for g, group in enumerate(groups):
            if mask >> g & 1:
                (csum,) = PART_SUM.unpack(_read_exact(src, PART_SUM.size))
                data = _read_exact(src, group.bytes_per_block)
                if checksum(data) != csum:
                    raise InvalidArgument(f"block {count} ({h.hex()})'s part of group {group.name!r} fails its "
                                          "checksum; the file is damaged. Blocks before it were imported")
                parts[g] = data
        count += 1
        yield _Parts(h, b"" if parent == NO_PARENT else parent, parts)


def _import_parts(admin: AdminClient, src: BinaryIO, header: ExportHeader,
                  progress: Progress | None) -> ImportResult:
    """Put back every block of a grouped export with exactly its parts: runs of a chain
    in which each group's parts are consecutive, each one Put naming them."""
    layout = layout_to_proto(header.layout)
    n_groups = len(header.layout.groups)
    step = _batch_count(header.block_bytes)
    blocks = stored = existing = 0
    run: list[_Parts] = []

    def flush() -> None:
        nonlocal stored, existing
        if not run:
            return
        spans = []
        for g in range(n_groups):
            at = [k for k, r in enumerate(run) if g in r.parts]
            spans.append((g, at[0], at[-1] + 1) if at else (g, 0, 0))
        parts = [run[k].parts[g] for g, a, b in spans for k in range(a, b)]
        hashes = [r.block_hash for r in run]
        resp = admin.put_parts(layout, hashes, run[0].parent_hash, spans, parts)
        if list(resp.block_hashes) != hashes:
            raise FailedPrecondition("the daemon stored these blocks under other hashes; is it a compatible version?")
        stored += resp.stored
        existing += resp.existing
        if progress is not None:
            progress(len(run))
        run.clear()

    def breaks(record: _Parts) -> bool:
        """Whether `record` cannot join the run: not its next block, the run full, or a
        group's parts in the run would no longer be consecutive."""
        if not run:
            return False
        if record.parent_hash != run[-1].block_hash or len(run) >= step:
            return True
        return any(g in record.parts and g not in run[-1].parts and any(g in r.parts for r in run)
                   for g in range(n_groups))

    try:
        for record in _part_records(src, header):
            blocks += 1
            if breaks(record):
                flush()
            run.append(record)
    except InvalidArgument:
        flush()
        raise
    flush()
    return ImportResult(blocks, stored, existing)


def import_namespace(admin: AdminClient, src: BinaryIO, progress: Progress | None = None) -> ImportResult:
    """Put every block of an export file into the daemon, in chained batches."""
    header = read_header(src)
    if header.layout.groups:
        return _import_parts(admin, src, header, progress)
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
    # A grouped file's blocks hold some of their parts: the estimate counts whole ones.
    record = (PARTS.size + PART_SUM.size * len(header.layout.groups)) if header.layout.groups else RECORD.size
    return max(0, (os.stat(path).st_size - header_end - END.size) // (record + header.block_bytes))
