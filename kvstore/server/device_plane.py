"""The device (CUDA IPC) data plane's calls: DeviceSegment, DeviceFetch, DevicePut.

Primitives: `DevicePlane` (`segment()`, `fetch(request)`, `put(request)`).

An engine on the same GPU node imports the HBM tier's slab once (`DeviceSegment`: the
IPC handles of its storage, its ref counter and its event) and then moves blocks with
device-to-device copies; fetches and puts carry offsets into that slab, exactly as the
shared-memory plane's do into the host segment, so both planes share the lease and put
logic of `LocalPlane`. The answer carries the host segment's token, so a client checks
that the slab and the segment it already mapped belong to the same daemon.
"""

from __future__ import annotations

import os
from typing import Any

from kvstore.core.store import Store
from kvstore.errors import FailedPrecondition
from kvstore.server.local_plane import LocalPlane
from kvstore.tiers import HBM
from kvstore.v1 import kvstore_pb2

# The tier the device plane serves from and puts into.
DEVICE_TIER = HBM


class DevicePlane:
    def __init__(self, store: Store, local: LocalPlane) -> None:
        self.store = store
        self.local = local

    def _hbm(self) -> Any:
        """The HBM tier (a `kvstore.tiers.hbm.HbmTier`, typed loosely: its module imports torch)."""
        tier = next((st.tier for st in self.store.tiers if st.name == DEVICE_TIER), None)
        if tier is None:
            raise FailedPrecondition("this daemon has no HBM tier; use the shared-memory plane (LocalFetch)")
        return tier

    def segment(self) -> kvstore_pb2.DeviceSegmentResponse:
        seg = self.local.require_segment()
        export = self._hbm().ipc_export()
        return kvstore_pb2.DeviceSegmentResponse(
            device_uuid=export.device_uuid, ipc_handle=export.ipc_handle, storage_bytes=export.storage_bytes,
            storage_offset=export.storage_offset, ref_counter_handle=export.ref_counter_handle,
            ref_counter_offset=export.ref_counter_offset, event_handle=export.event_handle,
            event_sync_required=export.event_sync_required, pid=os.getpid(), token=seg.token,
            # The slab itself: the allocator's capacity rounds the configured one down.
            capacity_bytes=export.storage_bytes,
        )

    async def fetch(self, request: kvstore_pb2.LocalFetchRequest) -> kvstore_pb2.LocalFetchResponse:
        self._hbm()
        return self.local.lease_blocks(request, DEVICE_TIER)

    async def put(self, request: kvstore_pb2.LocalPutRequest) -> kvstore_pb2.LocalPutResponse:
        self._hbm()
        return await self.local.begin_put(request, DEVICE_TIER)
