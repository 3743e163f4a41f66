"""The device (CUDA IPC) data plane's calls: DeviceSegment, DeviceFetch, DevicePut.

Primitives: `DevicePlane` (`segment()`, `fetch(request)`, `put(request)`).

An engine on the same GPU node imports the HBM tier's slab once (`DeviceSegment`: the
IPC handles of its storage, its ref counter and its event) and then moves blocks with
device-to-device copies; fetches and puts carry offsets into that slab, exactly as the
shared-memory plane's do into the host segment, so both planes share the lease and put
logic of `LocalPlaneService`. The answer carries the host segment's token (the caller's
tenant's segment, with auth on), so a client checks that the slab and the segment it
already mapped belong to the same daemon.

The slab holds every tenant's HBM blocks, and a CUDA IPC handle opens all of it. So
while more than one tenant may use the local planes (`local_plane = true` for two or
more tenants of the token file), the device plane is refused, FAILED_PRECONDITION: the
SDK then moves CUDA tensors through host memory. Per-tenant slabs are future work.

Glossary of planes and lanes: docs/local-data-plane.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kvstore.core.store import Store
from kvstore.errors import FailedPrecondition
from kvstore.server.local_plane import LocalPlaneService
from kvstore.tiers import HBM
from kvstore.v1 import kvstore_pb2

# The tier the device plane serves from and puts into.
DEVICE_TIER = HBM


SHARED_SLAB = ("the device plane opens the whole HBM slab, which holds every tenant's blocks, and {n} tenants "
               "may use the local planes (local_plane = true); it is off until per-tenant slabs exist: "
               "CUDA tensors go through host memory")


class DevicePlane:
    def __init__(self, store: Store, local: LocalPlaneService, local_plane_tenants: Callable[[], int] = lambda: 1) -> None:
        self.store = store
        self.local = local
        # How many tenants may use the local planes now (the token file can be reloaded).
        self._local_plane_tenants = local_plane_tenants

    def _hbm(self) -> Any:
        """The HBM tier (a `kvstore.tiers.hbm.HbmTier`, typed loosely: its module imports
        torch), when the device plane may be used."""
        tier = next((st.tier for st in self.store.tiers if st.name == DEVICE_TIER), None)
        if tier is None:
            raise FailedPrecondition("this daemon has no HBM tier; use the shared-memory plane (LocalFetch)")
        n = self._local_plane_tenants()
        if n > 1:
            raise FailedPrecondition(SHARED_SLAB.format(n=n))
        return tier

    def segment(self) -> kvstore_pb2.DeviceSegmentResponse:
        hbm = self._hbm()
        seg = self.local.require_segment()
        export = hbm.ipc_export()
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
