"""`Access`: the keys `corral serve` checks, owned in one place: the configuration's
(`configured_keys`) and the key file's, which it reads again, off the event loop, when the
file changes."""

from __future__ import annotations

import asyncio
import logging

from corral.access.audit import AuditTrail
from corral.access.keyfile import KeyBook, KeyFile, KeyFileError
from corral.access.principals import KeyRing, Principal

log = logging.getLogger("corral.access")

CHECK_EVERY_S = 1.0  # a key created or revoked with `corral keys` counts within this


class Access:
    """The ring of keys now (`ring`), from the configuration's (`configured`: (digest,
    principal) pairs) and `file`. Built at start, where
    a key file that cannot be read is a `KeyFileError` (Corral never opens up because its key
    file is damaged); `run` reads the file again when it changes, keeping the keys it had if
    the new file cannot be read."""

    def __init__(self, configured: list[tuple[str, Principal]], file: KeyFile | None) -> None:
        self._configured = configured
        self.file = file
        self._stamp = file.stamp() if file is not None else None
        self.book = file.read() if file is not None else KeyBook({}, [], [])
        self._said: set[str] = set()
        self.ring = self._ring(self.book)
        # The audit log's writer (set once the store is open): key changes go there.
        self.trail: AuditTrail | None = None

    @property
    def open(self) -> bool:
        """No key anywhere: every caller may do everything, as before keys."""
        return len(self.ring) == 0

    def describe(self) -> str:
        """One line for the log at start: who may call."""
        if self.open:
            made = f" in {self.file.path}" if self.file is not None else ""
            return (
                "no API keys: every caller may use every route (`corral keys create NAME` "
                f"makes one{made})"
            )
        names = [p.name for p in self.ring.principals()]
        also = f" and {self.file.path}" if self.file is not None else ""
        return f"keys of {len(names)} principals ({', '.join(names)}) from the config{also}"

    def _ring(self, book: KeyBook) -> KeyRing:
        for problem in book.problems:
            if problem not in self._said:  # each said once, not at every read
                self._said.add(problem)
                log.warning("%s", problem)
        return KeyRing([*self._configured, *book.live()])

    async def run(self) -> None:
        """Read the key file again each time it changes, until cancelled; the audit log is
        told of the keys made and revoked (at start too: changes made while stopped)."""
        if self.trail is not None:
            self.trail.keys(self.book)
        file = self.file
        if file is None:
            return
        failed = False
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            stamp = await asyncio.to_thread(file.stamp)
            if stamp == self._stamp:
                continue
            try:
                book = await asyncio.to_thread(file.read)
            except KeyFileError as exc:
                if not failed:
                    log.error("%s; the keys read before stay in force", exc)
                failed = True
                continue
            failed = False
            self._stamp = stamp
            before = len(self.ring)
            self.book = book
            self.ring = self._ring(book)
            if self.trail is not None:
                self.trail.keys(book)
            log.info(
                "keys: %d now (%d before), from %s and the config",
                len(self.ring),
                before,
                file.path,
            )
