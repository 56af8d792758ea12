"""`AuditTrail`: what goes into the audit log (the store's `audit` role): each admin action
that succeeded (who, which route, on which model) and each key made or revoked (from the key
file: who ran `corral keys`, and when). Written off the event loop; a store that cannot be
reached costs a warning, never the request."""

from __future__ import annotations

import asyncio
import logging

from corral.access.keyfile import KeyBook
from corral.background import Background
from corral.store import Audit, StoreError

log = logging.getLogger("corral.access")


def admin_action(method: str, path: str) -> tuple[str, str] | None:
    """The (action, target) an admin route's call is, or None for a read (logs)."""
    if method not in ("POST", "DELETE", "PUT"):
        return None
    if path in ("/unload", "/api/models/unload"):
        return "model.unload", "*"
    if path.startswith("/api/models/unload/"):
        return "model.unload", path.removeprefix("/api/models/unload/")
    if path.startswith("/api/models/"):
        model, _, verb = path.removeprefix("/api/models/").rpartition("/")
        if verb in ("load", "unload") and model:
            return f"model.{verb}", model
    return None


class AuditTrail:
    """Keeps admin actions and key changes in `audit` (None: no store; nothing kept)."""

    def __init__(self, audit: Audit | None) -> None:
        self._audit = audit
        self._busy = Background("audit", log)
        self._told: set[tuple[str, str]] = set()  # key changes handed to the store already

    def action(self, principal: str, method: str, path: str, status: int) -> None:
        """`principal`'s call `method path` ended with `status`: kept if it was an admin
        action that succeeded."""
        what = admin_action(method, path)
        if what is None or status >= 400 or self._audit is None:
            return
        action, target = what
        self._keep(principal, action, target, f"{method} {path}", None, False)

    def keys(self, book: KeyBook) -> None:
        """The key file read now: each key made and revoked is kept (once, at its time)."""
        if self._audit is None:
            return
        for k in book.keys:
            target = f"{k.principal}:{k.id}"
            changes = [("key.create", k.created_by, k.created_at)]
            if k.revoked_at is not None:
                changes.append(("key.revoke", k.revoked_by, k.revoked_at))
            for action, who, at in changes:
                if (action, target) not in self._told:  # each file read lists every key
                    self._told.add((action, target))
                    self._keep(who or "corral keys", action, target, "", at, True)

    def _keep(
        self, who: str, action: str, target: str, detail: str, at: float | None, once: bool
    ) -> None:
        audit = self._audit
        assert audit is not None

        async def write() -> None:
            try:
                await asyncio.to_thread(audit.record, who, action, target, detail, at, once)
            except StoreError as exc:
                log.warning("audit log: %s %s %s not kept: %s", who, action, target, exc)

        self._busy.spawn(write())

    async def close(self, wait_s: float = 5.0) -> None:
        """Wait (`wait_s` at most) for the entries being written, then stop."""
        running = self._busy.running()
        if running:
            await asyncio.wait(running, timeout=wait_s)
        await self._busy.cancel_and_wait()
