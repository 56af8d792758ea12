"""BatchService over the memory store with an injected clock: limits, expiry, cancel and
finalizing, without a server (the e2e tests run the same through HTTP)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corral.batch.fields import BatchError
from corral.batch.files import FileStorage
from corral.batch.service import BatchService
from corral.config import BatchConfig
from corral.store import MemoryStore, TaskStatus


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def service(tmp_path: Path, **limits: object) -> tuple[BatchService, MemoryStore, Clock]:
    clock = Clock()
    store = MemoryStore(clock=clock)
    files = FileStorage(tmp_path / "files")
    svc = BatchService(store, files, BatchConfig.model_validate(limits), {"m": "m"}.get, clock)
    return svc, store, clock


def upload(svc: BatchService, n: int, owner: str | None = None) -> str:
    file_id = svc.files.new_id()
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "m", "input": "x"},
            }
        )
        for i in range(n)
    ]
    data = ("\n".join(lines) + "\n").encode()
    svc.files.write(file_id, [data])
    svc.add_file(file_id, "in.jsonl", "batch", len(data), owner=owner)
    return file_id


def test_queued_requests_and_batches_have_limits_that_name_themselves(tmp_path: Path) -> None:
    svc, _, _ = service(tmp_path, max_queued_requests=5, max_queued_batches=2)
    svc.create(upload(svc, 3), "/v1/embeddings")
    with pytest.raises(BatchError, match=r"limit is 5 \(batch.max_queued_requests\)") as err:
        svc.create(upload(svc, 3), "/v1/embeddings")
    assert (err.value.status, err.value.code) == (429, "queue_full")
    svc.create(upload(svc, 2), "/v1/embeddings")
    with pytest.raises(BatchError, match=r"limit is 2 \(batch.max_queued_batches\)"):
        svc.create(upload(svc, 1), "/v1/embeddings")


def test_past_its_window_a_batch_expires_and_reports_every_unrun_line(tmp_path: Path) -> None:
    svc, store, clock = service(tmp_path, completion_windows=["24h", "1h"])
    b = svc.create(upload(svc, 4), "/v1/embeddings", completion_window="1h")
    (t,) = store.claim("m", "w", 1, 30.0)
    store.finish(t.id, t.lease_token or "", {"status_code": 200, "request_id": "q", "body": {}})
    assert svc.tick() == (1, [])
    clock.t += 3601
    svc.tick()
    ended = store.batches.get(b.id)
    assert ended.status == "expired"
    obj = svc.object(ended)
    assert obj["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    assert obj["expired_at"] == int(clock.t)
    errors = svc.files.path(obj["error_file_id"]).read_text().splitlines()
    assert [json.loads(x)["error"]["code"] for x in errors] == ["batch_expired"] * 3
    assert store.batches.counts(b.id) == {TaskStatus.SUCCEEDED: 1, TaskStatus.CANCELLED: 3}


def test_finalizing_twice_changes_nothing(tmp_path: Path) -> None:
    # A crash after the files were written and recorded: the next tick finishes the job.
    svc, store, _ = service(tmp_path)
    b = svc.create(upload(svc, 2), "/v1/embeddings")
    svc.cancel(b.id)
    data = {**store.batches.get(b.id).data, "finalizing_at": 1}
    store.batches.update(b.id, "finalizing", data, ["cancelling"])
    svc.tick()
    first = svc.object(store.batches.get(b.id))
    assert first["status"] == "cancelled"
    store.batches.update(b.id, "finalizing", store.batches.get(b.id).data, ["cancelled"])
    svc.tick()
    again = svc.object(store.batches.get(b.id))
    assert (
        again["request_counts"]
        == first["request_counts"]
        == {
            "total": 2,
            "completed": 0,
            "failed": 2,
        }
    )
    assert [f.id for f in store.files.list(purpose="batch_output")] == [first["error_file_id"]]


def test_an_undelivered_webhook_is_found_again_after_a_restart(tmp_path: Path) -> None:
    svc, store, clock = service(tmp_path, webhook_hosts=["hooks.local"])
    b = svc.create(upload(svc, 1), "/v1/embeddings", webhook_url="http://hooks.local/x")
    (t,) = store.claim("m", "w", 1, 30.0)
    store.finish(t.id, t.lease_token or "", {"status_code": 200, "request_id": "q", "body": {}})
    _, due = svc.tick()
    assert [(w.batch_id, w.url, w.body["status"]) for w in due] == [
        (b.id, "http://hooks.local/x", "completed")
    ]
    svc.webhook_sent(b.id, "HTTP 500")
    assert svc.tick() == (0, [])  # backing off: 2 s after the first failure
    again = BatchService(svc.store, svc.files, svc.limits, svc.resolve, clock)  # a restart
    clock.t += 3
    _, due = again.tick()
    assert [w.batch_id for w in due] == [b.id]
    again.webhook_sent(b.id, None)
    assert again.tick() == (0, [])
    hook = store.batches.get(b.id).data["webhook"]
    assert (hook["tries"], hook["delivered_at"]) == (2, int(clock.t))


def test_an_expired_file_is_gone_at_once_and_swept_from_disk(tmp_path: Path) -> None:
    svc, store, clock = service(tmp_path)
    kept, expiring = upload(svc, 1), svc.files.new_id()
    svc.files.write(expiring, [b"x\n"])
    svc.add_file(expiring, "x.jsonl", "batch", 2, expires_after_s=3600)
    assert svc.file_object(svc.file(expiring))["expires_at"] == 1_000 + 3600
    clock.t += 3599
    assert svc.file(expiring).id == expiring
    clock.t += 2
    page, _ = svc.list_files(None, None, 10, "desc")
    assert [f.id for f in page] == [kept]  # listed no more ...
    with pytest.raises(BatchError, match="has expired") as err:
        svc.file(expiring)  # ... nor readable
    assert err.value.status == 404
    other = svc.files.new_id()
    svc.files.write(other, [b"y\n"])
    svc.add_file(other, "y.jsonl", "batch", 2, expires_after_s=3600)
    clock.t += 3601
    assert svc.sweep() == 1  # the sweep deletes the record and the bytes
    assert not svc.files.path(other).exists()
    assert [f.id for f in store.files.list()] == [kept]


def test_a_validating_batch_cancelled_before_its_check_never_starts(tmp_path: Path) -> None:
    svc, store, _ = service(tmp_path, validate_inline_mb=0)
    b = svc.create(upload(svc, 3), "/v1/embeddings")
    assert b.status == "validating"
    assert svc.cancel(b.id).status == "cancelling"
    svc.tick()
    ended = store.batches.get(b.id)
    assert ended.status == "cancelled"
    assert store.batches.counts(b.id) == {}  # its lines were never stored


def test_two_owners_batches_take_turns_on_a_model_by_their_weights(tmp_path: Path) -> None:
    """Bob's batch, made while ann's 6 lines wait, runs beside them (two of his lines to one
    of hers at weight 2) instead of after them; his is checked by the tick (`validating`)."""
    svc, store, _ = service(tmp_path, validate_inline_mb=0.002)  # 2 kB: his file is larger
    ann = svc.create(upload(svc, 6, "ann"), "/v1/embeddings", owner="ann")
    bob = svc.create(upload(svc, 40, "bob"), "/v1/embeddings", owner="bob", weight=2.0)
    assert (ann.status, bob.status) == ("in_progress", "validating")
    svc.tick()
    order: list[str] = []
    while got := store.claim("m", "w", 1, 30.0):
        order.append("a" if got[0].batch_id == ann.id else "b")
    assert "".join(order) == "ab" + "abb" * 5 + "b" * 29
