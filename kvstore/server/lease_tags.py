"""Tenant-tagged lease ids and session keys: what keeps one tenant out of another's
leases and hints when the daemon serves several.

Primitives: `LeaseTags(key)` with `tag(lease_id)` (a store lease id as it leaves for the
caller), `untag(tagged)` (the store's id behind what a caller sent back, or "" when it
is not the caller's tenant's) and `session(session_id)` (the policies' key for a
client's session id).

With auth off (`key` None) every caller is the one default tenant and all three are
the identity. With auth on, a lease id leaves as `<id>.<tag>`, the tag a MAC (keyed by
a secret made at start-up) of the caller's tenant and the id, so a leaked or guessed
id of another tenant names nothing; admins may end any lease. Session ids become a
digest of tenant and id, so tenants choosing the same id never share hints.
The caller is `kvstore.server.auth.current_identity()`, set by the per-call pipeline.
"""

from __future__ import annotations

import hashlib
import hmac

from kvstore.server.auth import current_identity

TAG_CHARS = 16
SESSION_DIGEST_CHARS = 32


class LeaseTags:
    def __init__(self, key: bytes | None) -> None:
        self.key = key

    def _mac(self, tenant: str, lease_id: str) -> str:
        assert self.key is not None
        msg = tenant.encode() + b"\0" + lease_id.encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()[:TAG_CHARS]

    def tag(self, lease_id: str) -> str:
        """`lease_id` (a store lease id; empty: no lease) as the caller receives it."""
        if not lease_id or self.key is None:
            return lease_id
        return f"{lease_id}.{self._mac(current_identity().tenant, lease_id)}"

    def untag(self, tagged: str) -> str:
        """The store's lease id behind `tagged`; empty (no lease) when the tag is not the
        caller's tenant's."""
        if not tagged or self.key is None:
            return tagged
        lease_id, _, tag = tagged.rpartition(".")
        who = current_identity()
        if who.is_admin and lease_id:
            return lease_id
        if not lease_id or not hmac.compare_digest(tag.encode(), self._mac(who.tenant, lease_id).encode()):
            return ""
        return lease_id

    def session(self, session_id: str) -> str:
        """The policies' key for the caller's `session_id` (already checked)."""
        if self.key is None:
            return session_id
        tenant = current_identity().tenant
        digest = hashlib.sha256(tenant.encode() + b"\0" + session_id.encode()).hexdigest()
        return "t:" + digest[:SESSION_DIGEST_CHARS]
