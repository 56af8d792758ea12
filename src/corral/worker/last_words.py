"""A worker's last words: which tasks it is running right now, kept in a file on this host, so
that if its process dies (kill -9, a segfault, the OOM killer, `os._exit` in a handler) another
worker on the same host can tell the store which task was running (`Store.blame_death`).

Without them, a task started in a group whose worker died gets its attempt back and runs alone
from then on, since any task of the group may have killed the worker (see `corral.store.base`);
a task that kills its worker then costs one crash more than its `max_attempts`. With them, the
tasks that were running count the attempt, as tasks started alone always do, and the rest of
the group loses nothing and keeps running in groups.

The file: `<folder>/<store key>-<worker>.words`, memory-mapped, so a record costs a copy into
the page cache (no system call, no write to the database) and outlives the process. A header
(JSON: store identity, worker id, pid) padded to `HEADER` bytes, then `SLOTS` slots of `SLOT`
bytes, each `"<task id> <lease token>\\n"` padded with spaces, or all spaces when free. A byte
at the end of the header turns `!` for good if a record did not fit (then the words are
incomplete and not used). The worker holds an exclusive `flock` on the file while it lives; the
kernel drops it when the process dies, however it dies, so a file whose lock can be taken is a
dead worker's. A torn record (the process died mid-copy) does not parse, or names no task the
store still holds under that token: `blame_death` then changes nothing.

Workers on other hosts cannot read the file: if none on the dying worker's host reads it before
the lease expires, the group rule applies.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from corral.store import StoreError, Task
from corral.store.roles import TaskWork

log = logging.getLogger("corral.worker")

HEADER = 1024
SLOT = 128
SLOTS = 1024  # tasks running at once in one worker (batches count each task); 129 KiB a file
_RECORD = re.compile(rb"(\S+) (\S+)\n *")
_STALE_S = 7 * 86400.0  # another database's dead worker's file is removed after this long


def folder() -> Path:
    """Where this host's workers keep their last words: `$CORRAL_RUN_DIR`, else
    `$XDG_RUNTIME_DIR/corral`, else `<temp dir>/corral-<uid>`."""
    if os.environ.get("CORRAL_RUN_DIR"):
        return Path(os.environ["CORRAL_RUN_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "corral"
    return Path(tempfile.gettempdir()) / f"corral-{os.getuid()}"


def _key(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


class LastWords:
    """This worker's file. `say` before a handler runs, `unsay` after; both are a copy into
    memory. Does nothing where the store has no `identity` or the file cannot be made."""

    def __init__(self, store: TaskWork, worker_id: str, where: Path | None = None) -> None:
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._free = list(range(SLOTS - 1, -1, -1))
        self._lock = threading.Lock()
        self.path: Path | None = None
        if store.identity is None:
            return
        where = where or folder()
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)
        path = where / f"{_key(store.identity)}-{name}.words"
        try:
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            log.warning("cannot keep last words in %s (%s): a group death costs more", where, exc)
            return
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else holds it
        header = json.dumps(
            {"identity": store.identity, "worker_id": worker_id, "pid": os.getpid()}
        ).encode()
        size = HEADER + SLOT * SLOTS
        os.ftruncate(fd, size)
        self._mm = mmap.mmap(fd, size)
        self._mm[:HEADER] = header.ljust(HEADER - 1) + b"\n"
        self._mm[HEADER:] = b" " * (SLOT * SLOTS)
        self._fd, self.path = fd, path

    def say(self, tasks: Sequence[Task]) -> list[int]:
        """Record that `tasks` are running; returns their slots for `unsay`."""
        mm = self._mm
        if mm is None:
            return []
        slots = []
        for t in tasks:
            record = f"{t.id} {t.lease_token}\n".encode()
            with self._lock:
                slot = self._free.pop() if self._free and len(record) <= SLOT else -1
            if slot < 0:  # out of room: these words would be incomplete, so never use them
                mm[HEADER - 1 : HEADER] = b"!"
                continue
            start = HEADER + slot * SLOT
            mm[start : start + SLOT] = record.ljust(SLOT)
            slots.append(slot)
        return slots

    def unsay(self, slots: list[int]) -> None:
        mm = self._mm
        if mm is None:
            return
        for slot in slots:
            start = HEADER + slot * SLOT
            mm[start : start + SLOT] = b" " * SLOT
            with self._lock:
                self._free.append(slot)

    def close(self) -> None:
        """A clean exit: nothing is running, so the file goes."""
        if self._mm is None or self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._mm.close()
        os.close(self._fd)
        self._mm = None


def hear_the_dead(store: TaskWork, where: Path | None = None) -> int:
    """Read the last words of this host's dead workers on `store`, tell the store which tasks
    were running (`blame_death`) and remove the files; returns how many dead workers were
    heard. A file stays if the store cannot be reached (read again next time)."""
    if store.identity is None:
        return 0
    where = where or folder()
    heard = 0
    with contextlib.suppress(FileNotFoundError):
        for path in sorted(where.glob(f"{_key(store.identity)}-*.words")):
            heard += _hear(store, path)
        for path in where.glob("*.words"):  # other databases' dead workers, long gone
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > _STALE_S and _dead(path):
                    path.unlink()
    return heard


def _dead(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _hear(store: TaskWork, path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return 0  # its worker lives (or another worker is reading it)
        if os.fstat(fd).st_nlink == 0:
            return 0  # read and removed by another worker meanwhile
        data = os.pread(fd, HEADER + SLOT * SLOTS, 0)
        try:
            header = json.loads(data[: HEADER - 1])
        except ValueError:
            header = {}
        if header.get("identity") != store.identity:
            return 0  # a hash collision, or a file cut short: not this database's
        worker_id = str(header["worker_id"])
        running = _records(data)
        if running is None:
            log.warning(
                "worker %s died; its last words are incomplete, so its group runs' tasks get "
                "the attempt back and run alone",
                worker_id,
            )
            settled = 0
        else:
            settled = store.blame_death(worker_id, running)
            log.warning(
                "worker %s died while running %s: %s",
                worker_id,
                ", ".join(task_id for task_id, _ in running) or "no handler",
                f"{settled} of its tasks settled"
                if settled or not running
                else "its tasks had already moved on (the group rule applies)",
            )
        path.unlink()
        return 1
    except StoreError as exc:
        log.warning("cannot read worker last words into the store yet: %s", exc)
        return 0
    finally:
        os.close(fd)


def _records(data: bytes) -> list[tuple[str, str]] | None:
    """The running tasks the file names, or None if its words are incomplete or torn."""
    if len(data) < HEADER + SLOT * SLOTS or data[HEADER - 1 : HEADER] == b"!":
        return None
    out = []
    for start in range(HEADER, HEADER + SLOT * SLOTS, SLOT):
        record = data[start : start + SLOT]
        if record.isspace():
            continue
        match = _RECORD.fullmatch(record)
        if match is None:
            return None
        out.append((match[1].decode(), match[2].decode()))
    return out
