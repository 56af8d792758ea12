"""`/health`'s view of the store (batch/attached.py, `StoreHealth`): answered from the last
ping, never waiting on the store, and a ping left unanswered is a problem of its own."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from corral.batch.attached import StoreHealth
from corral.store.sqlite import SqliteStore

pytestmark = pytest.mark.unit


def test_health_is_answered_from_the_last_ping_while_the_store_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(StoreHealth, "EVERY_S", 0.05)
    monkeypatch.setattr(StoreHealth, "STALE_S", 1.0)
    store = SqliteStore(tmp_path / "tasks.db")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # a writer in a long transaction: the ping waits on its lock
        with store._tx(write=True):
            held.set()
            release.wait(30)

    async def main() -> list[str | None]:
        health = StoreHealth(store)
        runner = asyncio.ensure_future(health.run())
        seen = [await health.problem()]  # the first ping is waited for
        holder = threading.Thread(target=hold)
        holder.start()
        await asyncio.to_thread(held.wait, 10)
        await asyncio.sleep(0.2)  # a ping is waiting on the lock now
        started = time.monotonic()
        seen.append(await health.problem())
        assert time.monotonic() - started < 0.5  # answered at once, not after the writer
        await asyncio.sleep(1.5)  # past STALE_S
        seen.append(await health.problem())
        release.set()
        await asyncio.to_thread(holder.join, 10)
        await asyncio.sleep(0.3)
        seen.append(await health.problem())
        runner.cancel()
        return seen

    seen = asyncio.run(main())
    store.close()
    assert seen[0] is None
    assert seen[1] is None
    assert seen[2] is not None
    assert "has not answered a ping" in seen[2]
    assert seen[3] is None
