"""Task ids: version-4 UUIDs as 32 hex digits, made in bulk."""

from __future__ import annotations

import uuid

from corral.store.base import new_ids


def test_new_ids_are_distinct_version_4_uuids_in_hex() -> None:
    ids = new_ids(20_000)
    assert len(set(ids)) == 20_000
    for tid in ids[:500]:
        u = uuid.UUID(tid)
        assert (u.hex, u.version, u.variant) == (tid, 4, uuid.RFC_4122)
    assert new_ids(0) == []
