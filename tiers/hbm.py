"""The HBM tier: one slab of device memory on one GPU, and its copier to host memory.

The slab is a torch uint8 CUDA tensor; offsets come from a best-fit `ExtentAllocator`,
so the tier never calls the caching allocator after start. Bytes move only through
`HbmHostCopier`:

- Two CUDA streams, one per direction, each FIFO: host->device loads on a stream with
  higher priority than device->host stores, so a fetch that needs a block in HBM is not
  queued behind demotions.
- Host bytes go through pinned staging buffers (a small pool), so every copy is an
  asynchronous DMA and `non_blocking=True` really does not block the caller.
- Completion is a CUDA event recorded after the copy on its stream and polled from the
  event loop (`wait_event`); nothing here calls `synchronize()`. A write returns only
  after its event completed, so the store marks a block READY in HBM only once its
  bytes have landed; a staging buffer returns to the pool only after its event too.
- `ipc_export()`: the slab's CUDA IPC handle (torch's storage sharing), made once, so a
  co-located engine process can open the slab and copy blocks device-to-device (the
  device data plane, docs/local-data-plane.md). The slab is never freed or moved while
  the tier lives, so one handle stays valid for every client.

Imported only when CUDA exists (the daemon checks first): importing it imports torch.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.core.tier import Copier, Slot, Tier
from kvstore.tiers.cuda import wait_event
from kvstore.tiers.slab import SlabTier

logger = logging.getLogger(__name__)

HBM_ALIGNMENT = 256
# Staging buffers kept per size; enough for the copies a migration batch has in flight.
STAGING_PER_SIZE = 16


@dataclass(frozen=True, slots=True)
class DeviceExport:
    """What another process needs to open the slab: the fields of torch's CUDA storage
    sharing (`UntypedStorage._share_cuda_`), plus the GPU's UUID (ordinals differ
    between processes under CUDA_VISIBLE_DEVICES)."""

    device_uuid: str
    ipc_handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class HbmHostCopier:
    """Host <-> device copies on two FIFO streams, completion observed through events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Lower number = higher priority (torch maps out-of-range values to the nearest).
        self.load_stream = torch.cuda.Stream(device=device, priority=-1)
        self.store_stream = torch.cuda.Stream(device=device, priority=0)
        self._staging: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.loads = 0
        self.stores = 0

    def _take(self, n: int) -> torch.Tensor:
        pool = self._staging[n]
        return pool.pop() if pool else torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def _give(self, buf: torch.Tensor) -> None:
        pool = self._staging[buf.numel()]
        if len(pool) < STAGING_PER_SIZE:
            pool.append(buf)

    async def load(self, dst: torch.Tensor, data: Any) -> None:
        """Copy host bytes `data` into device tensor `dst`; returns after the copy landed."""
        n = dst.numel()
        staging = self._take(n)
        event: torch.cuda.Event | None = None
        try:
            staging.numpy()[:] = np.frombuffer(data, dtype=np.uint8, count=n)
            with torch.cuda.stream(self.load_stream):
                dst.copy_(staging, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.load_stream)
            await wait_event(event)
            self.loads += 1
        finally:
            # Only after the event (or on cancellation before the copy was queued): a
            # staging buffer still being read by the DMA must not be refilled.
            if event is None or event.query():
                self._give(staging)

    async def load_from_host(self, dst: torch.Tensor, view: memoryview) -> None:
        """Copy a host view (the pinned host tier) straight into `dst`; no staging."""
        src = torch.frombuffer(view, dtype=torch.uint8)
        with torch.cuda.stream(self.load_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.load_stream)
        # The caller holds the source block until this returns: its bytes stay put
        # while the DMA reads them.
        await wait_event(event)
        self.loads += 1

    async def store_to_host(self, src: torch.Tensor, view: memoryview) -> None:
        """Copy `src` straight into a host view (the pinned host tier)."""
        dst = torch.frombuffer(view, dtype=torch.uint8)
        with torch.cuda.stream(self.store_stream):
            self.store_stream.wait_stream(self.load_stream)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.store_stream)
        await wait_event(event)
        self.stores += 1

    async def store(self, src: torch.Tensor) -> bytes:
        """A host copy of device tensor `src`, returned after the copy landed."""
        n = src.numel()
        staging = self._take(n)
        event: torch.cuda.Event | None = None
        try:
            with torch.cuda.stream(self.store_stream):
                # The copy must see every write queued before it on the load stream.
                self.store_stream.wait_stream(self.load_stream)
                staging.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.store_stream)
            await wait_event(event)
            self.stores += 1
            return staging.numpy().tobytes()
        finally:
            if event is None or event.query():
                self._give(staging)


class HostToHbmCopier(Copier):
    """Host view -> device slab on the load stream (a DMA when the host memory is pinned)."""

    name = "host->hbm dma"

    def __init__(self, hbm: HbmTier) -> None:
        self.hbm = hbm

    async def copy(self, src: Tier, src_slot: Slot, dst: Tier, dst_slot: Slot, nbytes: int) -> None:
        view = src.view(src_slot, nbytes)
        assert view is not None and dst is self.hbm
        await self.hbm.copier.load_from_host(self.hbm.tensor(dst_slot, nbytes), view)


class HbmToHostCopier(Copier):
    """Device slab -> host view on the store stream."""

    name = "hbm->host dma"

    def __init__(self, hbm: HbmTier) -> None:
        self.hbm = hbm

    async def copy(self, src: Tier, src_slot: Slot, dst: Tier, dst_slot: Slot, nbytes: int) -> None:
        view = dst.view(dst_slot, nbytes)
        assert view is not None and src is self.hbm
        await self.hbm.copier.store_to_host(self.hbm.tensor(src_slot, nbytes), view)


class HbmTier(SlabTier):
    name = "hbm"

    def __init__(self, capacity_bytes: int, device: int = 0, alignment: int = HBM_ALIGNMENT) -> None:
        super().__init__(capacity_bytes, alignment)
        self.device = torch.device("cuda", device)
        self._slab = torch.empty(max(self._extents.capacity_bytes, 1), dtype=torch.uint8, device=self.device)
        self.copier = HbmHostCopier(self.device)
        self._export: DeviceExport | None = None
        logger.info("hbm tier: %d bytes on %s (%s)", capacity_bytes, self.device,
                    torch.cuda.get_device_name(self.device))

    def copier_from_host(self, src: Tier) -> Copier | None:
        return HostToHbmCopier(self) if src.has_host_view else None

    def copier_to_host(self, dst: Tier) -> Copier | None:
        return HbmToHostCopier(self) if dst.has_host_view else None

    def tensor(self, slot: Slot, nbytes: int) -> torch.Tensor:
        """The device bytes of a slot (for CUDA IPC export and device-to-device copies)."""
        return self._slab[slot.offset : slot.offset + nbytes]

    def ipc_export(self) -> DeviceExport:
        """The slab's IPC handle, made on first use and then reused: torch registers one
        reference counter per share, and the slab outlives every client anyway.

        Sharing swaps the storage's data pointer for a reference-counted one at the same
        address (torch keeps the memory until importers let go), so slot tensors taken
        before and after stay valid."""
        if self._export is None:
            storage = self._slab.untyped_storage()
            (_device, handle, size, offset, rc_handle, rc_offset, event_handle,
             event_sync) = storage._share_cuda_()  # type: ignore[attr-defined]
            self._export = DeviceExport(
                device_uuid=device_uuid(self.device), ipc_handle=bytes(handle), storage_bytes=int(size),
                storage_offset=int(offset), ref_counter_handle=bytes(rc_handle), ref_counter_offset=int(rc_offset),
                event_handle=bytes(event_handle), event_sync_required=bool(event_sync),
            )
            logger.info("hbm tier: slab exported for CUDA IPC (%d bytes)", int(size))
        return self._export

    async def write(self, slot: Slot, offset: int, data: memoryview | bytes) -> None:
        n = len(data)
        if offset < 0 or offset + n > slot.size:
            raise ValueError(f"write of {n} bytes at {offset} overflows a {slot.size}-byte slot")
        if n:
            start = slot.offset + offset
            await self.copier.load(self._slab[start : start + n], data)

    async def read(self, slot: Slot, nbytes: int) -> bytes:
        return await self.copier.store(self._slab[slot.offset : slot.offset + nbytes])

    def close(self) -> None:
        if self._slab is None:
            return
        self._slab = None  # type: ignore[assignment]
        torch.cuda.empty_cache()

    def describe(self) -> dict[str, str]:
        return {
            "backing": f"torch CUDA tensor on {self.device}",
            "device_name": torch.cuda.get_device_name(self.device),
            "alignment": str(self._extents.alignment),
            "loads": str(self.copier.loads),
            "stores": str(self.copier.stores),
        }
