"""CUDA glue for the host and HBM tiers: availability, host-memory pinning, copies.

Nothing here imports torch at module import: `kvstore` must load on machines without
torch or CUDA. Each function imports torch lazily, and only after a cheap check that an
NVIDIA device node exists, so CPU-only machines never pay for importing torch.

Primitives: `cuda_unavailable_reason(device)`, `pin_host_memory(buffer)` (cudaHostRegister
through torch's cudart binding; `PinnedMemory.unpin` undoes it), `wait_event(event)`
(polls a CUDA event from the event loop: `synchronize()` would block every other call).
"""

from __future__ import annotations

import asyncio
import ctypes
import glob
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Event polling backs off from 50 us to 2 ms: a 1 MiB copy takes ~40 us on PCIe 5, so
# the first polls catch small copies early, and long ones cost few wake-ups.
POLL_FIRST_S = 50e-6
POLL_MAX_S = 2e-3


def _nvidia_device_nodes() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/nvidiactl")


def cuda_unavailable_reason(device: int = 0) -> str:
    """'' when CUDA device `device` can hold the HBM tier, else why it cannot."""
    if not _nvidia_device_nodes():
        return "CUDA not available (no NVIDIA device on this machine)"
    try:
        import torch
    except ImportError:
        return "CUDA not available (torch is not installed)"
    if not torch.cuda.is_available():
        return "CUDA not available (torch has no usable CUDA runtime or driver)"
    count = torch.cuda.device_count()
    if device >= count:
        return f"gpu {device} does not exist (this machine has {count}); fix --gpu"
    return ""


def cuda_available() -> bool:
    return cuda_unavailable_reason(0) == ""


@dataclass(slots=True)
class PinnedMemory:
    """A host range registered with CUDA (page-locked, DMA-able)."""

    address: int
    size: int
    registered: bool = True

    def unpin(self) -> None:
        if not self.registered:
            return
        import torch

        err = torch.cuda.cudart().cudaHostUnregister(self.address)
        self.registered = False
        if int(err) != 0:
            logger.warning("cudaHostUnregister failed with error %d", int(err))


def buffer_address(buf: Any) -> int:
    """Start address of a writable buffer (memoryview of an mmap, bytearray...)."""
    c_obj = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(c_obj)
    finally:
        del c_obj  # drop the export so the owner (an mmap) can still be closed


def pin_host_memory(buf: Any) -> PinnedMemory | None:
    """Page-lock `buf` with cudaHostRegister if CUDA is present; None otherwise.

    Pinned memory lets HBM copies run as asynchronous DMA on a stream; pageable memory
    makes the driver stage through its own buffer and the copy blocks the caller.
    """
    if len(buf) == 0 or cuda_unavailable_reason(0):
        return None
    import torch

    address = buffer_address(buf)
    err = torch.cuda.cudart().cudaHostRegister(address, len(buf), 0)
    if int(err) != 0:
        logger.warning("cudaHostRegister of %d bytes failed with error %d; host tier stays pageable",
                       len(buf), int(err))
        return None
    logger.info("host tier pinned: %d bytes registered with CUDA", len(buf))
    return PinnedMemory(address, len(buf))


async def wait_event(event: Any) -> None:
    """Return once a recorded CUDA event has completed, without blocking the loop."""
    delay = POLL_FIRST_S
    while not event.query():
        await asyncio.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)
