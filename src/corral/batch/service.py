"""The Batch API's logic over a `Store` and a `FileStorage`: create (check the file, store the
batch and its lines in one transaction), the batch object, cancel, and `tick`, which ends
batches whose lines are all done (writing the output and error files), expires late ones and
delivers webhooks. Synchronous: the HTTP side calls it in threads.

Lifecycle: in_progress -> finalizing -> completed; a file with bad lines: failed (with every
problem and its line); cancel: cancelling -> finalizing -> cancelled; past the completion
window: the unrun lines are cancelled, then finalizing -> expired. A file over
`batch.validate_inline_mb` is checked after the batch is created, which is `validating` until
`tick` has checked it. Every line ends in exactly one of the two files; writing them is the
`Finalizer`'s (batch/finalize.py), idempotent, so a crash midway is finished by the next `tick`
after a restart.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from corral.access.principals import may_use
from corral.batch.fields import BatchError, completion_window_s, expires_after_s, metadata_of
from corral.batch.files import FileStorage
from corral.batch.finalize import Finalizer
from corral.batch.jsonl import ENDPOINTS, check, tasks
from corral.batch.webhooks import WebhookRefused, check_url, resolve_host
from corral.config import BatchConfig
from corral.store import (
    Batch,
    BatchNotFound,
    FileNotFound,
    NewTask,
    StoredFile,
    TaskStatus,
)
from corral.store.roles import BatchWork

_ENDED = ("completed", "failed", "expired", "cancelled")
_LIVE = ("validating", "in_progress", "cancelling", "finalizing")
WEBHOOK_TRIES = 5
STORING_GRACE_S = 600.0  # a batch's creator stores 50,000 lines in about 2 s on 2 cores
_SWEEP_S = 60.0  # how often expired files are deleted


@dataclass(frozen=True)
class Webhook:
    """A due webhook: POST `body` to `url` (the caller sends it and reports back)."""

    batch_id: str
    url: str
    body: dict[str, Any]


class BatchService:
    def __init__(
        self,
        store: BatchWork,
        files: FileStorage,
        limits: BatchConfig,
        resolve: Callable[[str], str | None],
        clock: Callable[[], float] = time.time,
        lookup: Callable[[str, int], list[str]] = resolve_host,
        max_line_bytes: int = 32 << 20,
    ) -> None:
        """`lookup`: a host's addresses, for checking webhook targets (DNS by default).
        `max_line_bytes`: the cap on one line (`batch.max_line_mb`, else the server's body
        limit)."""
        self.store, self.files, self.limits = store, files, limits
        self.max_line_bytes = max_line_bytes
        self.resolve = resolve
        self.clock = clock
        self.lookup = lookup
        self._scanned = False  # `tick` has read every batch once
        self._hooks: set[str] = set()  # ended batches whose webhook is still to be delivered
        self._finalizer = Finalizer(store, files, clock, self.add_file)
        self._swept_at = 0.0
        # Where a large file is checked and its lines stored, if not here (batch/checker.py).
        self.elsewhere: Callable[[str], None] | None = None

    # --- files --------------------------------------------------------------------------------
    def add_file(
        self,
        file_id: str,
        filename: str,
        purpose: str,
        size: int,
        expires_after_s: int | None = None,
        owner: str | None = None,
    ) -> StoredFile:
        """Record a file whose bytes are stored; `expires_after_s` (see `expires_after`): it is
        deleted that long after now (None: `file_expiry_days` after). `owner`: the principal
        that made it."""
        now = self.clock()
        keep_s: float | None = expires_after_s
        if keep_s is None and self.limits.file_expiry_days is not None:
            keep_s = self.limits.file_expiry_days * 86_400
        expires_at = None if keep_s is None else now + keep_s
        path = str(self.files.path(file_id))
        f = StoredFile(file_id, purpose, filename, size, now, path, expires_at, owner)
        self.store.files.add(f)
        return f

    def file(self, file_id: str, read: bool = False, owner: str | None = None) -> StoredFile:
        """The file's record; `read`: its bytes must be readable here (503 if another node of a
        cluster wrote them to a folder this one does not share). `owner`: 404 unless it is that
        principal's (another's is not revealed)."""
        try:
            f = self.store.files.get(file_id)
        except FileNotFound:
            raise BatchError(404, f"no file with id {file_id!r}", "file_not_found") from None
        if owner is not None and f.owner != owner:
            raise BatchError(404, f"no file with id {file_id!r}", "file_not_found")
        if f.expires_at is not None and f.expires_at <= self.clock():
            self._forget(f)
            raise BatchError(404, f"file {file_id!r} has expired", "file_not_found")
        if read and not Path(f.path).is_file():
            raise BatchError(
                503,
                f"file {file_id!r} was written to {f.path}, which this server cannot read: the "
                "`corral serve` nodes sharing a store must share server.data_dir too (one "
                "folder, mounted at the same path on every host)",
                "file_unavailable",
            )
        return f

    def list_files(
        self,
        purpose: str | None,
        after: str | None,
        limit: int,
        order: str,
        owner: str | None = None,
    ) -> tuple[list[StoredFile], bool]:
        """A page of files (unexpired; `owner`: only that principal's) and whether more follow;
        400 for an unknown `after`."""
        now = self.clock()
        return _page(
            after, limit, self.store.files.get, FileNotFound, "file",
            lambda n: self.store.files.list(
                purpose, after, n, order="asc" if order == "asc" else "desc", owner=owner
            ),
            lambda f: f.expires_at is None or f.expires_at > now,
        )  # fmt: skip

    def list_batches(
        self, after: str | None, limit: int, owner: str | None = None
    ) -> tuple[list[Batch], bool]:
        """A page of batches (`owner`: only that principal's), newest first, and whether more
        follow; 400 for an unknown `after`."""
        return _page(
            after, limit, self.store.batches.get, BatchNotFound, "batch",
            lambda n: self.store.batches.list(after, n, owner=owner),
        )  # fmt: skip

    def _forget(self, f: StoredFile) -> None:
        with contextlib.suppress(FileNotFound):
            self.store.files.delete(f.id)
        self.files.remove(f.id)

    def sweep(self) -> int:
        """Delete every expired file, and `.part` files their writer left; returns how many
        expired."""
        self.files.sweep_parts()
        now = self.clock()
        gone = 0
        for f in _every(lambda after: self.store.files.list(after=after, limit=PAGE, order="asc")):
            if f.expires_at is not None and f.expires_at <= now:
                self._forget(f)
                gone += 1
        return gone

    def delete_file(self, file_id: str, owner: str | None = None) -> StoredFile:
        """Delete the file (`owner`: 404 unless it is that principal's)."""
        if owner is not None:
            self.file(file_id, owner=owner)
        try:
            f = self.store.files.delete(file_id)
        except FileNotFound:
            raise BatchError(404, f"no file with id {file_id!r}", "file_not_found") from None
        self.files.remove(file_id)
        return f

    @staticmethod
    def file_object(f: StoredFile) -> dict[str, Any]:
        return {
            "id": f.id,
            "object": "file",
            "bytes": f.bytes,
            "created_at": int(f.created_at),
            "expires_at": None if f.expires_at is None else int(f.expires_at),
            "filename": f.filename,
            "purpose": f.purpose,
            "status": "processed",
        }

    # --- batches ------------------------------------------------------------------------------
    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: Any = "24h",
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        webhook_url: str | None = None,
        model: str | None = None,
        output_expires_after: Any = None,
        owner: str | None = None,
        models: Sequence[str] = (),
        weight: float = 1.0,
    ) -> Batch:
        """Check the input file and store the batch with its lines (or, if any line is bad, the
        failed batch with every problem); a file over `validate_inline_mb` is stored
        `validating` and checked by `tick`. `model` (a Corral extension) runs every line on that
        model whatever its body says. `owner`: the principal making it, whose input file it
        must be and whose idempotency keys are its own; `models`: the names or globs of the
        models it may use (none: all), a line naming another failing as one naming a model not
        served; `weight`: its owner's, in the turns its lines take with other owners' on each
        model. Raises `BatchError` for a bad request."""
        if endpoint not in ENDPOINTS:
            raise BatchError(
                400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "invalid_value", "endpoint"
            )
        window_s = completion_window_s(completion_window, self.limits.completion_windows)
        metadata = metadata_of(metadata)
        output_expires_s = (
            None
            if output_expires_after is None
            else expires_after_s(output_expires_after, "output_expires_after")
        )
        webhook_url = webhook_url or (metadata or {}).get("webhook_url")
        if webhook_url:
            self._check_webhook(webhook_url)
        source = self.file(input_file_id, read=True, owner=owner)
        if source.purpose != "batch":
            raise BatchError(
                400,
                f"file {input_file_id} has purpose {source.purpose!r}; upload with purpose=batch",
                "invalid_value",
                "input_file_id",
            )
        self._check_room()
        override = None if model is None else self._override(model, models)
        now = self.clock()
        data: dict[str, Any] = {
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "expires_at": int(now + window_s),
            "metadata": metadata,
            "request_total": 0,
            "webhook_url": webhook_url,
            "model": override,
            "output_expires_after_s": output_expires_s,
        }
        if models:
            data["models_allowed"] = list(models)
        if weight != 1.0:  # its owner's, in its turns with other owners' batches
            data["weight"] = weight
        batch_id = f"batch_{uuid.uuid4().hex}"
        # One principal's idempotency key never names another's batch ('/' is in no name).
        key = (
            idempotency_key
            if owner is None or idempotency_key is None
            else f"{owner}/{idempotency_key}"
        )
        if source.bytes > self.limits.validate_inline_mb * 1024 * 1024:
            return self.store.batches.create(
                Batch(batch_id, "validating", now, data, key, owner=owner), []
            )
        status, data, lines = self._checked(batch_id, owner, data, Path(source.path), now)
        return self.store.batches.create(
            Batch(batch_id, status, now, data, key, owner=owner), lines
        )

    def _override(self, model: Any, models: Sequence[str]) -> str:
        """The served model `model` (a batch's `model`, for every line) names; 404 unless it
        is served and one of `models` (names or globs; none: all)."""
        override = self.resolve(model) if isinstance(model, str) else None
        if override is None or not may_use(models, override):
            raise BatchError(404, f"model {model!r} is not served here", "model_not_found", "model")
        return override

    def _checked(
        self, batch_id: str, owner: str | None, data: dict[str, Any], path: Path, now: float
    ) -> tuple[str, dict[str, Any], Iterable[NewTask]]:
        """Check the input file: the batch's status, data and lines (`failed` with every
        problem, or `in_progress`). `BatchError` if the queue has no room for its lines."""
        allowed = data.get("models_allowed") or ()

        def resolve(name: str) -> str | None:
            model = self.resolve(name)
            return model if model is not None and may_use(allowed, model) else None

        checked = check(
            path,
            data["endpoint"],
            resolve,
            self.limits.max_lines,
            override=data["model"],
            max_line_bytes=self.max_line_bytes,
        )
        data = dict(data)
        data.pop("storing_at", None)
        if not checked.ok:
            data["errors"] = [e.as_dict() for e in checked.errors]
            data["failed_at"] = int(now)
            return "failed", data, []
        total = len(checked.models)
        queued = sum(c.get(TaskStatus.QUEUED, 0) for c in self.store.counts().values())
        if queued + total > self.limits.max_queued_requests:
            raise BatchError(
                429,
                f"{queued} requests are queued and this batch has {total}; the limit is "
                f"{self.limits.max_queued_requests} (batch.max_queued_requests)",
                "queue_full",
            )
        data["request_total"] = total
        data["in_progress_at"] = int(now)
        data["started_s"] = now  # precise, for the run time in `corral.run_s`
        data["models"] = dict(Counter(checked.models))  # lines per model, for ETAs
        # Each owner's lines take turns with the other owners' on each model, by weight.
        weight = float(data.get("weight", 1.0))
        starts = self.store.batches.starts(set(checked.models), owner, self.limits.priority)
        lines = tasks(
            path,
            checked,
            batch_id,
            self.limits.priority,
            self.limits.max_attempts,
            starts,
            weight,
        )
        return "in_progress", data, lines

    def validate(self, batch_id: str) -> Batch:
        """Check a `validating` batch's file and start it (or fail it); the batch as it is
        after (a batch no longer `validating` is left as it is)."""
        b = self.store.batches.get(batch_id)
        return self._validate(b) if b.status == "validating" else b

    def _validate(self, b: Batch) -> Batch:
        """Check a `validating` batch's file and start it (or fail it)."""
        if self.elsewhere is not None:
            self.elsewhere(b.id)
            return self.store.batches.get(b.id)
        now = self.clock()
        try:
            source = self.file(b.data["input_file_id"], read=True)
            status, data, lines = self._checked(b.id, b.owner, b.data, Path(source.path), now)
        except BatchError as exc:
            problem = {"code": exc.code, "message": str(exc), "param": exc.param, "line": None}
            status, data, lines = "failed", {**b.data, "errors": [problem]}, []
            data["failed_at"] = int(now)
        started = self.store.batches.start(b.id, status, data, lines)
        return started if started is not None else self.store.batches.get(b.id)

    def _check_room(self) -> None:
        live = sum(1 for _ in self._pages(_LIVE))
        if live >= self.limits.max_queued_batches:
            raise BatchError(
                429,
                f"{live} batches are not finished; the limit is "
                f"{self.limits.max_queued_batches} (batch.max_queued_batches)",
                "queue_full",
            )

    def _check_webhook(self, url: str) -> None:
        try:
            check_url(url, self.limits.webhook_hosts, self.lookup)
        except WebhookRefused as exc:
            raise BatchError(400, str(exc), "invalid_value", "webhook_url") from None

    def batch(self, batch_id: str, owner: str | None = None) -> Batch:
        """The batch (`owner`: 404 unless it is that principal's)."""
        try:
            b = self.store.batches.get(batch_id)
        except BatchNotFound:
            raise BatchError(404, f"no batch with id {batch_id!r}", "batch_not_found") from None
        if owner is not None and b.owner != owner:
            raise BatchError(404, f"no batch with id {batch_id!r}", "batch_not_found")
        return b

    def cancel(self, batch_id: str, owner: str | None = None) -> Batch:
        b = self.batch(batch_id, owner)
        if b.status in ("cancelling", "cancelled"):
            return b
        if b.status not in ("in_progress", "validating"):
            raise BatchError(
                409,
                f"batch {batch_id} is {b.status}; only a running batch can be cancelled",
                "invalid_state",
            )
        data = {**b.data, "cancelling_at": int(self.clock())}
        updated = self.store.batches.update(batch_id, "cancelling", data, expect=[b.status])
        if updated is None:  # it ended meanwhile
            return self.cancel(batch_id)
        self.store.batches.cancel(batch_id)
        return updated

    def live(self) -> list[Batch]:
        """Batches not yet ended, oldest first."""
        return list(self._pages(_LIVE))[::-1]

    def object(self, b: Batch) -> dict[str, Any]:
        """The Batch API's batch object, with Corral's `corral` extension (progress, ETA)."""
        d = b.data
        counts: dict[str, int] | None = d.get("request_counts")
        live = counts is None
        if counts is None:
            by = self.store.batches.counts(b.id)
            done = by.get(TaskStatus.SUCCEEDED, 0)
            failed = by.get(TaskStatus.FAILED, 0)
            counts = {"total": d["request_total"], "completed": done, "failed": failed}
        obj: dict[str, Any] = {
            "id": b.id,
            "object": "batch",
            "endpoint": d["endpoint"],
            "errors": {"object": "list", "data": d["errors"]} if d.get("errors") else None,
            "input_file_id": d["input_file_id"],
            "completion_window": d["completion_window"],
            "status": b.status,
            "output_file_id": d.get("output_file_id"),
            "error_file_id": d.get("error_file_id"),
            "created_at": int(b.created_at),
            "in_progress_at": d.get("in_progress_at"),
            "expires_at": d.get("expires_at"),
            "finalizing_at": d.get("finalizing_at"),
            "completed_at": d.get("completed_at"),
            "failed_at": d.get("failed_at"),
            "expired_at": d.get("expired_at"),
            "cancelling_at": d.get("cancelling_at"),
            "cancelled_at": d.get("cancelled_at"),
            "request_counts": counts,
            "usage": d.get("usage"),
            "metadata": d.get("metadata"),
        }
        ended = counts["completed"] + counts["failed"]
        total = counts["total"]
        extension: dict[str, Any] = {
            "progress": round(ended / total, 4) if total else (1.0 if not live else 0.0),
            "eta_s": None,
            "run_s": d.get("run_s"),  # in progress until every line ended (float seconds)
            "webhook_url": d.get("webhook_url"),
            "webhook": d.get("webhook"),
            "problem": d.get("problem"),  # why it is not moving on (a full disk), if stuck
        }
        if b.status == "in_progress":
            # Batches created before it and still running: a rough place in line (the
            # scheduler, not arrival, decides which lines run next).
            ahead = self.store.batches.list(after=b.id, limit=1000, status=["in_progress"])
            extension["queue_position"] = len(ahead)
        started = d.get("in_progress_at")
        if live and b.status == "in_progress" and started and ended:
            rate = ended / max(self.clock() - started, 1e-3)
            extension["eta_s"] = round((total - ended) / rate, 1)
        obj["corral"] = extension
        return obj

    # --- ending batches -----------------------------------------------------------------------
    def tick(self) -> tuple[int, list[Webhook]]:
        """End what can end: expire batches past their window, finalize those with no line left
        to run. Returns how many batches are still running, and the webhooks now due (send
        them, then `webhook_sent`)."""
        now = self.clock()
        if now - self._swept_at >= _SWEEP_S:
            self._swept_at = now
            self.sweep()
        due: list[Webhook] = []
        seen: set[str] = set()
        live = 0
        for b in self._batches():
            # A large batch is `validating` while its creator stores its lines (store/
            # sql_batches.py); past STORING_GRACE_S the creator is taken for gone.
            storing_at = b.data.get("storing_at") or -STORING_GRACE_S
            if b.status == "validating" and now - storing_at >= STORING_GRACE_S:
                b = self._validate(b)
            if b.status == "in_progress" and now >= b.data["expires_at"]:
                data = {**b.data, "expiring": True}
                if self.store.batches.update(b.id, "in_progress", data, ["in_progress"]):
                    self.store.batches.cancel(b.id)
                b = self.store.batches.get(b.id)
            if b.status in ("in_progress", "cancelling", "finalizing"):
                by = self.store.batches.counts(b.id)
                if not by.get(TaskStatus.QUEUED) and not by.get(TaskStatus.RUNNING):
                    b = self._finalizer.finish(b, now)
            if b.status in _ENDED and _hook_pending(b):
                self._hooks.add(b.id)
                # A batch that ended in this tick is read again from `_hooks` (it was live
                # when the tick began): one webhook per batch per tick.
                if now >= (b.data.get("webhook") or {}).get("next_at", 0) and b.id not in seen:
                    seen.add(b.id)
                    due.append(Webhook(b.id, b.data["webhook_url"], self.object(b)))
            else:
                self._hooks.discard(b.id)
            live += b.status in _LIVE
        return live, due

    def webhook_sent(self, batch_id: str, error: str | None) -> None:
        """Record a delivery attempt; a failed one is tried again with backoff."""
        b = self.store.batches.get(batch_id)
        hook = dict(b.data.get("webhook") or {})
        hook["tries"] = hook.get("tries", 0) + 1
        if error is None:
            hook["delivered_at"] = int(self.clock())
        else:
            hook["last_error"] = error
            hook["next_at"] = self.clock() + 2 ** hook["tries"]
        self.store.batches.update(batch_id, b.status, {**b.data, "webhook": hook}, [b.status])

    def _batches(self) -> Iterator[Batch]:
        """Batches that may have something to do: live ones, and ended ones whose webhook is
        not delivered yet. The first call reads every batch (webhooks a previous run left
        undelivered); later ones read only live batches and those known to wait."""
        if not self._scanned:
            self._scanned = True
            yield from (b for b in self._pages(None) if b.status in _LIVE or _hook_pending(b))
            return
        yield from self._pages(_LIVE)
        for batch_id in list(self._hooks):
            try:
                yield self.store.batches.get(batch_id)
            except BatchNotFound:
                self._hooks.discard(batch_id)

    def _pages(self, status: Sequence[str] | None) -> Iterator[Batch]:
        return _every(lambda after: self.store.batches.list(after=after, limit=PAGE, status=status))


def _hook_pending(b: Batch) -> bool:
    hook = b.data.get("webhook") or {}
    return (
        bool(b.data.get("webhook_url"))
        and not hook.get("delivered_at")
        and (hook.get("tries", 0) < WEBHOOK_TRIES)
    )


PAGE = 500  # items per store call when every one is walked


class _Identified(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T")
Item = TypeVar("Item", bound=_Identified)


def _page(
    after: str | None,
    limit: int,
    known: Callable[[str], object],
    missing: type[Exception],
    what: str,
    fetch: Callable[[int], list[T]],
    keep: Callable[[T], bool] | None = None,
) -> tuple[list[T], bool]:
    """Up to `limit` items that `fetch` gives after `after`, those `keep` keeps, and whether more
    follow; `after` must name a `what` that `known` finds (else 400 naming it)."""
    if after is not None:
        try:
            known(after)
        except missing:
            raise BatchError(
                400, f"after: no {what} with id {after!r}", "invalid_value", "after"
            ) from None
    page = fetch(limit + 1)
    kept = page if keep is None else [x for x in page if keep(x)]
    return kept[:limit], len(page) > limit


def _every(fetch: Callable[[str | None], list[Item]]) -> Iterator[Item]:
    """Every item `fetch` pages through, `PAGE` at a time, each page after the last's id."""
    after = None
    while page := fetch(after):
        yield from page
        after = page[-1].id
        if len(page) < PAGE:
            return
