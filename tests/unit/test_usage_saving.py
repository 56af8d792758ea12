"""`Usage`'s saving: what was counted since the last save is handed out once, a failed save
is handed back and goes with the next, and rows read back from the store add to the hours."""

from __future__ import annotations

import asyncio
from pathlib import Path

from corral.access.usage import Usage, UsageSaver
from corral.store import UsageRow, open_store


def test_what_was_counted_is_handed_out_once_and_a_failed_save_goes_with_the_next() -> None:
    u = Usage()
    u.record("alice", "alice", "m", 10, 2, 0.5, now=3600.0)
    u.record("alice", "alice", "m", 5, 1, 0.5, now=3700.0)
    first = u.unsaved()
    assert first == [UsageRow(3600, "alice", "m", 2, 15, 3, 1.0, 0.0, 0.0)]
    assert u.unsaved() == []
    u.restore(first, saved=False)  # the store was down
    u.record("alice", "alice", "m", 1, 1, 0.0, now=3800.0)
    assert u.unsaved() == [UsageRow(3600, "alice", "m", 3, 16, 4, 1.0, 0.0, 0.0)]
    # Handing back never counts twice in what the server shows.
    assert u.rows("total")[0]["requests"] == 3


def test_rows_read_back_add_to_the_hours_and_old_ones_are_left_out() -> None:
    u = Usage(keep_hours=2)
    u.record("bob", "bob", "m", 1, 1, 0.0, now=10 * 3600.0)
    u.restore(
        [
            UsageRow(10 * 3600, "bob", "m", 4, 4, 4, 0.0, 0.0, 0.0),
            UsageRow(3 * 3600, "bob", "m", 9, 9, 9, 0.0, 0.0, 0.0),
        ]
    )
    assert [(r["period_start"], r["requests"]) for r in u.rows("hour")] == [(36000.0, 5)]
    assert u.unsaved()[0].requests == 1  # what was read back is not saved again


def test_the_saver_keeps_usage_across_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'u.db'}"

    async def one_run(n: int) -> int:
        store = open_store(url)
        u = Usage()
        saver = UsageSaver(u, store.usage)
        running = asyncio.ensure_future(saver.run())
        await asyncio.sleep(0.2)  # it has read back what was kept
        for _ in range(n):
            u.record("carol", "carol", "m", 1, 1, 0.0)
        running.cancel()
        await saver.save()
        store.close()
        return int(str(u.rows("total")[0]["requests"]))

    assert asyncio.run(one_run(2)) == 2
    assert asyncio.run(one_run(3)) == 5
