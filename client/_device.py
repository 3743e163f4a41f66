"""The client side of the device data plane: open the daemon's HBM slab by CUDA IPC
handle and move blocks device-to-device between it and the engine's CUDA tensors.

`DevicePlane.attach(resp, host_token)` opens the slab named by a `DeviceSegment` answer
once per client (torch's `UntypedStorage._new_shared_cuda`, i.e. cudaIpcOpenMemHandle),
after checking that the answer comes from the daemon whose host segment this client
already mapped (same token: same host) and from another process (CUDA refuses to open
a handle in its exporter). `copy_out` and `copy_in` queue the copies on the caller's
current CUDA stream, so they are ordered after whatever the engine queued on it.

Verification. There is no XXH3 on the device, and the daemon's checksums are XXH3-64 of
the bytes. So the copy is checked on the host: after the device-to-device copies, the
destination bytes (`copy_out`) or the source blocks (`copy_in`) go to a pinned host
buffer on the same stream, the stream is synchronized, and each block is hashed. As on
the shared-memory plane, a fetch hashes exactly what the engine got, and a put the
bytes the engine owns, never the slot, which another writer could have changed: a
slot whose bytes differ from its checksum fails the daemon's next read, a miss. A
fetched block that does not verify is not returned and the daemon is asked to
`Verify` it. This costs one device->host copy per block (PCIe,
tens of GB/s) next to the device-to-device copy; it is the price of never handing an
engine unverified KV.

Leases. `copy_out` returns only after the stream synchronized, so the slots' lease
(ended by the client's next call) never ends while a copy still reads them.

Imports torch: loaded only when a CUDA tensor is passed to the SDK.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from kvstore.errors import RESTARTED_PREFIX, DaemonRestarted, InvalidArgument
from kvstore.v1 import kvstore_pb2

logger = logging.getLogger(__name__)


def is_cuda_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and obj.device.type == "cuda"


def device_bytes(tensor: torch.Tensor, index: int, block_bytes: int) -> torch.Tensor:
    """A flat uint8 view of a contiguous CUDA tensor holding exactly one block."""
    if not tensor.is_contiguous():
        raise InvalidArgument(f"block {index} is not contiguous; call .contiguous() so it is one byte range")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.numel() != block_bytes:
        raise InvalidArgument(f"block {index} holds {flat.numel()} bytes; a block is {block_bytes} bytes")
    return flat


def _sizes(block_bytes: int | Sequence[int], n: int) -> list[int]:
    return [block_bytes] * n if isinstance(block_bytes, int) else list(block_bytes)


def _ordinal_for(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(f"the daemon's HBM tier is on GPU {uuid}, which this process does not see")


class DevicePlane:
    def __init__(self, slab: torch.Tensor, capacity_bytes: int, boot_id: int = 0) -> None:
        self.slab = slab
        self.boot_id = boot_id  # the start of the daemon whose slab this is (0: not told)
        self.device = slab.device
        self.capacity_bytes = capacity_bytes
        self._staging: torch.Tensor | None = None

    @classmethod
    def attach(cls, resp: kvstore_pb2.DeviceSegmentResponse, host_token: bytes, boot_id: int = 0) -> DevicePlane:
        """Open the daemon's slab; raises ValueError when this process cannot."""
        if resp.token != host_token:
            raise ValueError("the device segment's token differs from the host segment's: another daemon")
        if resp.pid == os.getpid():
            raise ValueError("the daemon runs in this process; CUDA IPC handles open only in other processes")
        if not torch.cuda.is_available():
            raise ValueError("this process has no usable CUDA runtime")
        ordinal = _ordinal_for(resp.device_uuid)
        torch.cuda._lazy_init()
        try:
            storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                ordinal, resp.ipc_handle, resp.storage_bytes, resp.storage_offset, resp.ref_counter_handle,
                resp.ref_counter_offset, resp.event_handle, resp.event_sync_required,
            )
        except RuntimeError as exc:
            raise ValueError(f"cannot open the HBM slab's IPC handle: {exc}") from None
        slab = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", ordinal))
        slab.set_(storage)  # type: ignore[call-overload]
        if slab.numel() < resp.capacity_bytes:
            raise ValueError(f"the opened slab holds {slab.numel()} bytes, the daemon says {resp.capacity_bytes}")
        return cls(slab, resp.capacity_bytes, boot_id)

    def close(self) -> None:
        # Dropped, not freed: a copy still running on another thread holds its own
        # reference to the slab's storage, which torch closes once the last one goes.
        self._staging = None
        self.slab = torch.empty(0, dtype=torch.uint8)

    def _slot(self, offset: int, nbytes: int) -> torch.Tensor:
        if not self.slab.is_cuda:
            raise DaemonRestarted(f"{RESTARTED_PREFIX}: this client let go of the old start's HBM slab; attach again")
        if offset < 0 or offset + nbytes > self.capacity_bytes:
            raise ValueError(f"slot [{offset}, +{nbytes}) lies outside the daemon's HBM slab")
        return self.slab[offset : offset + nbytes]

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:nbytes]

    def _check_device(self, tensors: Sequence[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise InvalidArgument(f"block {i} is on {t.device}; the daemon's HBM tier is on {self.device}")

    def _to_host_and_hash(self, stream: torch.cuda.Stream, sources: Sequence[torch.Tensor]) -> list[int]:
        """Queue a device->host copy of each source after the copies already queued on
        `stream`, wait for the stream, and hash each host copy."""
        if not sources:
            return []
        ends = [0]
        for src in sources:
            ends.append(ends[-1] + src.numel())
        host = self._host_buffer(ends[-1])
        with torch.cuda.stream(stream):
            for i, src in enumerate(sources):
                host[ends[i] : ends[i + 1]].copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        view = host.numpy()
        return [xxhash.xxh3_64_intdigest(view[ends[i] : ends[i + 1]].data) for i in range(len(sources))]

    def copy_out(self, offsets: Sequence[int], checksums: Sequence[int], block_bytes: int | Sequence[int],
                 dsts: Sequence[torch.Tensor]) -> int:
        """Copy slots into `dsts` (CUDA tensors) on the current stream, then verify the
        destinations; returns how many leading blocks verified. `block_bytes`: one size
        for all, or one per block (a grouped layout's parts, each its group's size)."""
        sizes = _sizes(block_bytes, len(dsts))
        flats = [device_bytes(d, i, sizes[i]) for i, d in enumerate(dsts)]
        self._check_device(flats)
        slots = [self._slot(off, sizes[i]) for i, off in enumerate(offsets)]
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            for dst, slot in zip(flats, slots):
                dst.copy_(slot, non_blocking=True)
        for i, (got, want) in enumerate(zip(self._to_host_and_hash(stream, flats), checksums)):
            if got != want:
                logger.warning("block %d failed verification after a device-to-device copy; not returned", i)
                return i
        return len(offsets)

    def copy_in(self, offsets: Sequence[int], blocks: Sequence[torch.Tensor],
                block_bytes: int | Sequence[int]) -> list[int]:
        """Copy each block into its slot (offset -1: already stored, skipped) on the
        current stream; returns the XXH3-64 of each block copied (0 for skipped).
        `block_bytes` as for `copy_out`."""
        sizes = _sizes(block_bytes, len(blocks))
        flats = [device_bytes(b, i, sizes[i]) for i, b in enumerate(blocks)]
        self._check_device(flats)
        todo = [(i, self._slot(off, sizes[i])) for i, off in enumerate(offsets) if off >= 0]
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            for i, slot in todo:
                slot.copy_(flats[i], non_blocking=True)
        # Hash the sources, not the slots: the checksum comes from bytes this client owns
        # (see the module docstring). The stream is synchronized before it returns, so the
        # commit that makes the blocks visible follows the device copies.
        sums = [0] * len(offsets)
        for (i, _), csum in zip(todo, self._to_host_and_hash(stream, [flats[i] for i, _ in todo])):
            sums[i] = csum
        return sums
