"""Ending a batch whose lines are all done: its output and error files written (two passes,
memory flat), its counts and usage, its final status. Idempotent, so a crash midway is finished
by the next try; a full disk leaves it `finalizing` with the problem said, tried again later."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from corral.batch.files import FileStorage
from corral.batch.jsonl import result_line
from corral.ratelog import Throttle, no_space
from corral.store import Batch, FileNotFound, StoredFile, Task
from corral.store.roles import BatchFiles

FINALIZE_RETRY_S = 5.0  # a batch whose files did not fit (a full disk) is tried again this often
throttle = Throttle(logging.getLogger("corral.batch"))


class Finalizer:
    """Ends batches (a part of `BatchService`, which calls `finish` from its `tick`).
    `add_file(file_id, filename, purpose, size, expires_after_s, owner)` records a written
    file (a batch's output files are its owner's)."""

    def __init__(
        self,
        store: BatchFiles,
        files: FileStorage,
        clock: Callable[[], float],
        add_file: Callable[[str, str, str, int, int | None, str | None], StoredFile],
    ) -> None:
        self.store, self.files, self.clock = store, files, clock
        self._add_file = add_file
        self._retry_at: dict[str, float] = {}  # batches whose files did not fit: when to retry

    def finish(self, b: Batch, now: float) -> Batch:
        """`_finalize`, unless writing its files failed on a full disk: then the batch stays
        `finalizing` with the problem in its object (`corral.problem`), and is tried again
        every FINALIZE_RETRY_S, so it ends on its own once space returns. Other batches go on
        meanwhile."""
        if now < self._retry_at.get(b.id, 0.0):
            return b
        try:
            done = self._finalize(b)
        except OSError as exc:
            if not no_space(exc):
                raise
            self._retry_at[b.id] = now + FINALIZE_RETRY_S
            problem = (
                f"cannot write the batch's output files: no space left on the device "
                f"({self.files.root}); tried again every {FINALIZE_RETRY_S:g} s until there is"
            )
            b = self.store.batches.get(b.id)
            if (b.data.get("problem") or {}).get("message") != problem:
                data = {**b.data, "problem": {"message": problem, "since": int(now)}}
                b = self.store.batches.update(b.id, b.status, data, [b.status]) or b
            throttle.warning(f"no space: {self.files.root}", "batch %s: %s", b.id, problem)
            return b
        self._retry_at.pop(b.id, None)
        return done

    def _finalize(self, b: Batch) -> Batch:
        now = int(self.clock())
        if b.status != "finalizing":
            data = {**b.data, "finalizing_at": now}
            moved = self.store.batches.update(b.id, "finalizing", data, [b.status])
            if moved is None:
                return self.store.batches.get(b.id)
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
        usage = Usage()
        out_id, err_id = f"file-{b.id}-output", f"file-{b.id}-errors"

        def lines() -> Iterator[tuple[bool, bytes, Task]]:
            after = 0
            while page := self.store.batches.tasks(b.id, after_seq=after, limit=1000):
                for t in page:
                    yield (*result_line(t, ending), t)
                after = page[-1].seq

        # Two passes over the lines (one per file) keep memory flat for big batches.
        def pick(want_ok: bool) -> Iterator[bytes]:
            nonlocal completed, failed
            for ok, line, t in lines():
                if ok == want_ok:
                    if ok:
                        completed += 1
                        usage.add(t.result)
                    else:
                        failed += 1
                    yield line

        out_size = self.files.write(out_id, pick(True))
        err_size = self.files.write(err_id, pick(False))
        data = dict(b.data)
        data.pop("problem", None)  # written at last
        keep_s = data.get("output_expires_after_s")
        if completed or not failed:
            self._record(out_id, f"{b.id}_output.jsonl", out_size, keep_s, b.owner)
            data["output_file_id"] = out_id
        else:
            self.files.remove(out_id)
        if failed:
            self._record(err_id, f"{b.id}_errors.jsonl", err_size, keep_s, b.owner)
            data["error_file_id"] = err_id
        else:
            self.files.remove(err_id)
        data["request_counts"] = {
            "total": data["request_total"],
            "completed": completed,
            "failed": failed,
        }
        data["usage"] = usage.as_dict()
        data[f"{final}_at"] = now
        data["run_s"] = round(self.clock() - data.get("started_s", b.created_at), 3)
        done = self.store.batches.update(b.id, final, data, ["finalizing"])
        return done if done is not None else self.store.batches.get(b.id)

    def _record(
        self, file_id: str, filename: str, size: int, keep_s: int | None, owner: str | None
    ) -> None:
        try:
            self.store.files.get(file_id)  # recorded by a finalize that crashed after it
        except FileNotFound:
            self._add_file(file_id, filename, "batch_output", size, keep_s, owner)


class Usage:
    """Token counts summed over a batch's answers, as the batch object's `usage`."""

    def __init__(self) -> None:
        self.input = self.output = self.total = self.cached = self.reasoning = 0

    def add(self, answer: Any) -> None:
        body = answer.get("body") if isinstance(answer, dict) else None
        u = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(u, dict):
            return
        prompt, completion = _count(u.get("prompt_tokens")), _count(u.get("completion_tokens"))
        self.input += prompt
        self.output += completion
        self.total += _count(u.get("total_tokens")) or prompt + completion
        self.cached += _count((u.get("prompt_tokens_details") or {}).get("cached_tokens"))
        details = u.get("completion_tokens_details") or {}
        self.reasoning += _count(details.get("reasoning_tokens"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input,
            "input_tokens_details": {"cached_tokens": self.cached},
            "output_tokens": self.output,
            "output_tokens_details": {"reasoning_tokens": self.reasoning},
            "total_tokens": self.total,
        }


def _count(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else 0
