"""This daemon's generation: a random boot id made at every start, which every plane
hands out (the `LocalSegment`, `DeviceSegment` and `DataLane` answers, the control
lane's hello answer, the data lane's WELCOME) and which a client sends back with each
call that names something of this start of the daemon: a segment's slots, a
reservation, a lease, a data lane transfer.

A client that attached before a restart holds a mapping of the old daemon's segment
(memory that is no longer the daemon's), reservations and leases that no longer exist.
Its calls reach the new daemon all the same (the control lane and gRPC reconnect by
themselves), so without a check a shared-memory put would be handed offsets in the new
segment, copy into the old one, and publish blocks that fail their first read: a silent
loss. With the check such a call is refused (`DaemonRestarted`, FAILED_PRECONDITION, see
`kvstore.errors` for why that status) before anything is handed out or published, and
the SDK attaches anew and calls again. A boot id of 0 (a client that never attached, or
predates generations) is not checked.

Primitives: `new_boot_id`, `Generation` (`boot_id`, `check`).
"""

from __future__ import annotations

import secrets

from kvstore.errors import RESTARTED_PREFIX, DaemonRestarted


def new_boot_id() -> int:
    """A random, non-zero 64-bit id (0 means "not known" on the wire)."""
    return secrets.randbits(64) | 1


class Generation:
    __slots__ = ("boot_id",)

    def __init__(self, boot_id: int | None = None) -> None:
        self.boot_id = boot_id if boot_id is not None else new_boot_id()

    def check(self, sent: int) -> None:
        """Refuse a call that names something of another start of this daemon."""
        if sent and sent != self.boot_id:
            raise DaemonRestarted(
                f"{RESTARTED_PREFIX} since this client attached (generation {sent:016x}, now {self.boot_id:016x}): "
                "the segment, reservations, leases and transfers it holds are gone; attach again (the SDK does "
                "this by itself) and call again")
