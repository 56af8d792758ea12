"""The Batch API's logic over a `Store` and a `FileStorage`: create (check the file, store the
batch and its lines in one transaction), the batch object, cancel, and `tick`, which ends
batches whose lines are all done (writing the output and error files), expires late ones and
delivers webhooks. Synchronous: the HTTP side calls it in threads.

Lifecycle: in_progress -> finalizing -> completed; a file with bad lines: failed (at once, with
every problem and its line); cancel: cancelling -> finalizing -> cancelled; past the
completion window: the unrun lines are cancelled, then finalizing -> expired. Every line ends
in exactly one of the two files. Finalizing is idempotent, so a crash midway is finished by the
next `tick` after a restart.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from corral.batch.files import FileStorage
from corral.batch.jsonl import ENDPOINTS, check, result_line, tasks
from corral.config import BatchConfig
from corral.store import Batch, BatchNotFound, FileNotFound, Store, StoredFile, TaskStatus

_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_ENDED = ("completed", "failed", "expired", "cancelled")
_LIVE = ("in_progress", "cancelling", "finalizing")
WEBHOOK_TRIES = 5


class BatchError(Exception):
    """A request the Batch API refuses: HTTP `status`, OpenAI error `code`, and `param`."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass(frozen=True)
class Webhook:
    """A due webhook: POST `body` to `url` (the caller sends it and reports back)."""

    batch_id: str
    url: str
    body: dict[str, Any]


class BatchService:
    def __init__(
        self,
        store: Store,
        files: FileStorage,
        limits: BatchConfig,
        resolve: Callable[[str], str | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.files, self.limits = store, files, limits
        self.resolve = resolve
        self.clock = clock
        self._scanned = False  # `tick` has read every batch once
        self._hooks: set[str] = set()  # ended batches whose webhook is still to be delivered

    # --- files --------------------------------------------------------------------------------
    def add_file(self, file_id: str, filename: str, purpose: str, size: int) -> StoredFile:
        f = StoredFile(
            file_id, purpose, filename, size, self.clock(), str(self.files.path(file_id))
        )
        self.store.add_file(f)
        return f

    def file(self, file_id: str) -> StoredFile:
        try:
            return self.store.get_file(file_id)
        except FileNotFound:
            raise BatchError(404, f"no file with id {file_id!r}", "file_not_found") from None

    def delete_file(self, file_id: str) -> StoredFile:
        try:
            f = self.store.delete_file(file_id)
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
            "filename": f.filename,
            "purpose": f.purpose,
            "status": "processed",
        }

    # --- batches ------------------------------------------------------------------------------
    def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
        webhook_url: str | None = None,
        model: str | None = None,
    ) -> Batch:
        """Check the input file and store the batch with its lines (or, if any line is bad, the
        failed batch with every problem). `model` (a Corral extension) runs every line on that
        model whatever its body says. Raises `BatchError` for a bad request."""
        if endpoint not in ENDPOINTS:
            raise BatchError(
                400, f"endpoint must be one of {', '.join(ENDPOINTS)}", "invalid_value", "endpoint"
            )
        window_s = _window_s(completion_window)
        metadata = _metadata(metadata)
        webhook_url = webhook_url or (metadata or {}).get("webhook_url")
        if webhook_url:
            self._check_webhook(webhook_url)
        source = self.file(input_file_id)
        if source.purpose != "batch":
            raise BatchError(
                400,
                f"file {input_file_id} has purpose {source.purpose!r}; upload with purpose=batch",
                "invalid_value",
                "input_file_id",
            )
        self._check_room()
        override = None
        if model is not None:
            override = self.resolve(model) if isinstance(model, str) else None
            if override is None:
                raise BatchError(
                    404, f"model {model!r} is not served here", "model_not_found", "model"
                )
        path = Path(source.path)
        checked = check(path, endpoint, self.resolve, self.limits.max_lines, override=override)
        now = self.clock()
        total = len(checked.models)
        data: dict[str, Any] = {
            "endpoint": endpoint,
            "input_file_id": input_file_id,
            "completion_window": completion_window,
            "expires_at": int(now + window_s),
            "metadata": metadata,
            "request_total": total,
            "webhook_url": webhook_url,
            "model": override,
        }
        batch_id = f"batch_{uuid.uuid4().hex}"
        if not checked.ok:
            data["errors"] = [e.as_dict() for e in checked.errors]
            data["failed_at"] = int(now)
            data["request_total"] = 0
            return self.store.create_batch(
                Batch(batch_id, "failed", now, data, idempotency_key), []
            )
        queued = sum(c.get(TaskStatus.QUEUED, 0) for c in self.store.counts().values())
        if queued + total > self.limits.max_queued_requests:
            raise BatchError(
                429,
                f"{queued} requests are queued and this batch has {total}; the limit is "
                f"{self.limits.max_queued_requests} (batch.max_queued_requests)",
                "queue_full",
            )
        data["in_progress_at"] = int(now)
        data["started_s"] = now  # precise, for the run time in `corral.run_s`
        data["models"] = dict(Counter(checked.models))  # lines per model, for ETAs
        lines = tasks(path, checked, batch_id, self.limits.priority, self.limits.max_attempts)
        return self.store.create_batch(
            Batch(batch_id, "in_progress", now, data, idempotency_key), lines
        )

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
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BatchError(
                400, "webhook_url must be an http(s) URL", "invalid_value", "webhook_url"
            )
        allowed = self.limits.webhook_hosts
        if allowed and parts.hostname not in allowed:
            raise BatchError(
                400,
                f"webhook host {parts.hostname!r} is not allowed (batch.webhook_hosts: "
                f"{', '.join(allowed)})",
                "invalid_value",
                "webhook_url",
            )

    def batch(self, batch_id: str) -> Batch:
        try:
            return self.store.get_batch(batch_id)
        except BatchNotFound:
            raise BatchError(404, f"no batch with id {batch_id!r}", "batch_not_found") from None

    def cancel(self, batch_id: str) -> Batch:
        b = self.batch(batch_id)
        if b.status in ("cancelling", "cancelled"):
            return b
        if b.status not in ("in_progress",):
            raise BatchError(
                409,
                f"batch {batch_id} is {b.status}; only a running batch can be cancelled",
                "invalid_state",
            )
        data = {**b.data, "cancelling_at": int(self.clock())}
        updated = self.store.update_batch(batch_id, "cancelling", data, expect=["in_progress"])
        if updated is None:  # it ended meanwhile
            return self.cancel(batch_id)
        self.store.cancel_batch(batch_id)
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
            by = self.store.batch_counts(b.id)
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
        }
        if b.status == "in_progress":
            # Batches created before it and still running: a rough place in line (the
            # scheduler, not arrival, decides which lines run next).
            ahead = self.store.list_batches(after=b.id, limit=1000, status=["in_progress"])
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
        due: list[Webhook] = []
        live = 0
        for b in self._batches():
            if b.status == "in_progress" and now >= b.data["expires_at"]:
                data = {**b.data, "expiring": True}
                if self.store.update_batch(b.id, "in_progress", data, ["in_progress"]):
                    self.store.cancel_batch(b.id)
                b = self.store.get_batch(b.id)
            if b.status in ("in_progress", "cancelling", "finalizing"):
                by = self.store.batch_counts(b.id)
                if not by.get(TaskStatus.QUEUED) and not by.get(TaskStatus.RUNNING):
                    b = self._finalize(b)
            if b.status in _ENDED and _hook_pending(b):
                self._hooks.add(b.id)
                if now >= (b.data.get("webhook") or {}).get("next_at", 0):
                    due.append(Webhook(b.id, b.data["webhook_url"], self.object(b)))
            else:
                self._hooks.discard(b.id)
            live += b.status in _LIVE
        return live, due

    def webhook_sent(self, batch_id: str, error: str | None) -> None:
        """Record a delivery attempt; a failed one is tried again with backoff."""
        b = self.store.get_batch(batch_id)
        hook = dict(b.data.get("webhook") or {})
        hook["tries"] = hook.get("tries", 0) + 1
        if error is None:
            hook["delivered_at"] = int(self.clock())
        else:
            hook["last_error"] = error
            hook["next_at"] = self.clock() + 2 ** hook["tries"]
        self.store.update_batch(batch_id, b.status, {**b.data, "webhook": hook}, [b.status])

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
                yield self.store.get_batch(batch_id)
            except BatchNotFound:
                self._hooks.discard(batch_id)

    def _pages(self, status: Sequence[str] | None) -> Iterator[Batch]:
        after = None
        while page := self.store.list_batches(after=after, limit=500, status=status):
            yield from page
            after = page[-1].id
            if len(page) < 500:
                return

    def _finalize(self, b: Batch) -> Batch:
        now = int(self.clock())
        if b.status != "finalizing":
            data = {**b.data, "finalizing_at": now}
            moved = self.store.update_batch(b.id, "finalizing", data, [b.status])
            if moved is None:
                return self.store.get_batch(b.id)
            b = moved
        ending = "batch_cancelled" if "cancelling_at" in b.data else "batch_expired"
        final = (
            "cancelled"
            if "cancelling_at" in b.data
            else "expired"
            if b.data.get("expiring")
            else "completed"
        )
        completed = failed = 0
        out_id, err_id = f"file-{b.id}-output", f"file-{b.id}-errors"

        def lines() -> Iterator[tuple[bool, bytes]]:
            after = 0
            while page := self.store.batch_tasks(b.id, after_seq=after, limit=1000):
                for t in page:
                    yield result_line(t, ending)
                after = page[-1].seq

        # Two passes over the lines (one per file) keep memory flat for big batches.
        def pick(want_ok: bool) -> Iterator[bytes]:
            nonlocal completed, failed
            for ok, line in lines():
                if ok == want_ok:
                    if ok:
                        completed += 1
                    else:
                        failed += 1
                    yield line

        out_size = self.files.write(out_id, pick(True))
        err_size = self.files.write(err_id, pick(False))
        data = dict(b.data)
        if completed or not failed:
            self._record(out_id, f"{b.id}_output.jsonl", out_size)
            data["output_file_id"] = out_id
        else:
            self.files.remove(out_id)
        if failed:
            self._record(err_id, f"{b.id}_errors.jsonl", err_size)
            data["error_file_id"] = err_id
        else:
            self.files.remove(err_id)
        data["request_counts"] = {
            "total": data["request_total"],
            "completed": completed,
            "failed": failed,
        }
        data[f"{final}_at"] = now
        data["run_s"] = round(self.clock() - data.get("started_s", b.created_at), 3)
        done = self.store.update_batch(b.id, final, data, ["finalizing"])
        return done if done is not None else self.store.get_batch(b.id)

    def _record(self, file_id: str, filename: str, size: int) -> None:
        try:
            self.store.get_file(file_id)  # recorded by a finalize that crashed after it
        except FileNotFound:
            self.add_file(file_id, filename, "batch_output", size)


def _hook_pending(b: Batch) -> bool:
    hook = b.data.get("webhook") or {}
    return (
        bool(b.data.get("webhook_url"))
        and not hook.get("delivered_at")
        and (hook.get("tries", 0) < WEBHOOK_TRIES)
    )


def _window_s(window: str) -> float:
    m = _WINDOW.match(window or "")
    if not m:
        raise BatchError(
            400,
            f"completion_window must look like 24h (a number and s, m, h or d); got {window!r}",
            "invalid_value",
            "completion_window",
        )
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise BatchError(
            400, "metadata must be at most 16 string keys and values", "invalid_value", "metadata"
        )
    return metadata
