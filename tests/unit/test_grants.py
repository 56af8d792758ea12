"""Grants to relay processes (`pipeline/grants.py`): each ends once, with its relay's report or,
when the relay left without one, counted as lost; a report is validated before it is used."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from corral.gateway.pipeline.grants import Grants, Report


async def _alive() -> bool:
    return False


def test_a_grant_ends_once_with_its_report() -> None:
    lost: list[str] = []
    grants = Grants(lost.append)
    ended: list[Report | None] = []
    response = grants.issue(
        "r0", {"url": "http://m/v1/chat/completions"}, b"{}", ended.append, _alive
    )
    assert len(grants) == 1
    head, _, body = response._content.partition(b"\n")  # type: ignore[attr-defined]
    grant = json.loads(head)
    assert grant["body_bytes"] == 2
    assert body == b"{}"
    report = Report(200, 1.5, 7, b"data: [DONE]\n\n", False)
    assert grants.report(grant["id"], report)
    grants.finish(grant["id"])
    grants.finish(grant["id"])  # the connection's end seen twice: nothing more happens
    assert ended == [report]
    assert lost == []
    assert len(grants) == 0
    assert not grants.report(grant["id"], report)  # ended: no longer open


def test_a_grant_whose_relay_left_without_a_report_is_lost_and_still_ends() -> None:
    lost: list[str] = []
    grants = Grants(lost.append)
    ended: list[Report | None] = []
    response = grants.issue("r1", {}, b"", ended.append, _alive)
    gid = json.loads(response._content.partition(b"\n")[0])["id"]  # type: ignore[attr-defined]
    grants.finish(gid)
    assert ended == [None]
    assert lost == ["r1"]


def test_a_report_round_trips_and_bad_ones_are_refused() -> None:
    report = Report(499, None, 3, bytes(range(256)), True, 2)
    assert Report.parse(report.to_json()) == report
    for bad in (b"[]", b"{}", b'{"status": "x"}', b"not json"):
        with pytest.raises((ValueError, KeyError, TypeError)):
            Report.parse(bad)


def test_the_report_route_answers_what_is_wrong() -> None:
    grants = Grants(lambda _: None)
    ended: list[Report | None] = []
    response = grants.issue("r0", {}, b"", ended.append, _alive)
    gid = json.loads(response._content.partition(b"\n")[0])["id"]  # type: ignore[attr-defined]

    def post(query: str, body: bytes) -> int:
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            return messages.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "query_string": query.encode(), "headers": []}
        asyncio.run(grants.answer_report(scope, receive, send))  # type: ignore[arg-type]
        status: int = sent[0]["status"]
        return status

    assert post("grant=nope", Report(200, None, 0, b"", False).to_json()) == 404
    assert post(f"grant={gid}", b"{not json") == 400
    assert post(f"grant={gid}", b"x" * 70_000) == 413
    assert post(f"grant={gid}", Report(200, None, 0, b"", False).to_json()) == 204
    grants.finish(gid)
    assert ended == [Report(200, None, 0, b"", False)]
