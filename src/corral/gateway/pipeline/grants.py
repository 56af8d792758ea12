"""Grants to relay processes: the scheduler's process decides, a relay process carries the bytes.

A relay process (`gateway/relays/`) passes each request it accepts to this process over a local
socket. A model call that can be relayed as it is (no dialect to translate, no kept `/props`) is
admitted here as any other; when its turn comes, instead of sending it to the model's server,
this process answers the relay with a *grant*: what to send where (`GRANT_HEADER`, then one JSON
line, then the body) and the answer's own headers. The relay sends it, streams the answer straight
to its client, reports how it ended (`POST END_PATH`), then closes the grant's connection.

The grant lives exactly as long as that connection: it ends when the relay closes it, with the
relay's report, or without one (the relay process died, or gave up before reading the grant):
then it is counted as lost (`corral_relay_lost_total`, status 502) and its slot freed all the
same. So a relay killed with `kill -9` frees every model slot it held, at once."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from corral.gateway.errors import error

log = logging.getLogger("corral.gateway")

RELAY_HEADER = b"x-corral-relay"  # the relay process that passed a request on (its id)
CLIENT_HEADER = b"x-corral-client"  # the address of the client the relay accepted it from
GRANT_HEADER = b"x-corral-grant"  # an answer that is a grant, not the client's answer
END_PATH = "/internal/relay/end"
EXITED_PATH = "/internal/relay/exited"  # whether a grant's model server died: this process says
_MAX_REPORT = 64 * 1024  # a report carries an answer's tail (TAIL_BYTES) and a few figures


@dataclass(frozen=True, slots=True)
class Report:
    """How a granted call ended, as its relay saw it."""

    status: int  # the answer's status; 499 where the client left mid-answer
    first_at: float | None  # monotonic time of the first chunk (one clock for every process)
    pieces: int  # pieces of text relayed (tokens, for a server that sends no usage)
    tail: bytes  # the answer's last bytes, where its usage is
    stream_error: bool  # the server cut the stream short (the client got an error event)
    retries: int = 0  # sent again on a fresh connection (a stale pooled one)

    @classmethod
    def parse(cls, raw: bytes) -> Report:
        """A report from its JSON; `ValueError` names what is wrong."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a report is a JSON object")
        first_at = data.get("first_at")
        return cls(
            int(data["status"]),
            float(first_at) if first_at is not None else None,
            int(data.get("pieces", 0)),
            str(data.get("tail", "")).encode("latin-1"),
            bool(data.get("stream_error", False)),
            int(data.get("retries", 0)),
        )

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "status": self.status,
                "first_at": self.first_at,
                "pieces": self.pieces,
                "tail": self.tail.decode("latin-1"),
                "stream_error": self.stream_error,
                "retries": self.retries,
            }
        ).encode()


Ended = Callable[[Report | None], None]
Exited = Callable[[], Awaitable[bool]]


class Grants:
    """The grants this process has given and not yet seen end, by id. `lost` counts those that
    ended without their relay's report."""

    def __init__(self, lost: Callable[[str], None]) -> None:
        self._ended: dict[str, tuple[str, Ended]] = {}  # id -> (relay id, what ends it)
        self._exited: dict[str, Exited] = {}  # id -> whether its model server died
        self._reports: dict[str, Report] = {}
        self._told: dict[str, asyncio.Future[None]] = {}  # id -> done when its report is in
        self._lost = lost

    def __len__(self) -> int:
        return len(self._ended)

    def issue(
        self, relay: str, grant: dict[str, Any], body: bytes, ended: Ended, exited: Exited
    ) -> Response:
        """The answer to relay `relay`: the grant (`grant`, JSON, with its id added) and the
        body to send. `ended` runs once when the grant ends, with the relay's report or None;
        `exited` says, after a failure, whether the model's server died (`EXITED_PATH`)."""
        gid = uuid.uuid4().hex
        self._ended[gid] = (relay, ended)
        self._exited[gid] = exited
        head = json.dumps({**grant, "id": gid, "body_bytes": len(body)}).encode()
        return _GrantResponse(self, gid, head + b"\n" + body)

    def report(self, gid: str, report: Report) -> bool:
        """The relay's report of grant `gid`; False if no such grant is open."""
        if gid not in self._ended:
            return False
        self._reports[gid] = report
        told = self._told.get(gid)
        if told is not None and not told.done():
            told.set_result(None)
        return True

    def told(self, gid: str) -> asyncio.Future[None]:
        """Done once grant `gid`'s report is in."""
        told = self._told.get(gid)
        if told is None:
            told = self._told[gid] = asyncio.get_running_loop().create_future()
            if gid in self._reports:
                told.set_result(None)
        return told

    def finish(self, gid: str) -> None:
        """The grant's connection closed: it ends, with its report if one came."""
        entry = self._ended.pop(gid, None)
        report = self._reports.pop(gid, None)
        self._exited.pop(gid, None)
        self._told.pop(gid, None)
        if entry is None:
            return
        relay, ended = entry
        if report is None:
            self._lost(relay)
            log.warning("relay %s: a grant ended without its report (the relay left)", relay)
        ended(report)

    async def answer_exited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`GET EXITED_PATH?grant=ID`: `{"exited": bool}` once the model's server has had its
        moment to be seen dead (up to 1 s), as this process answers its own failures."""
        exited = self._exited.get(_grant_id(scope))
        if exited is None:
            await error(404, "no open grant", "invalid_request_error")(scope, receive, send)
            return
        died = await exited()
        await Response(json.dumps({"exited": died}), media_type="application/json")(
            scope, receive, send
        )

    async def answer_report(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`POST END_PATH?grant=ID` with the report as its body: 204, or 400/404 naming why."""
        gid = _grant_id(scope)
        raw = b""
        more = True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
            if len(raw) > _MAX_REPORT:
                await error(413, "a relay's report is too large", "invalid_request_error")(
                    scope, receive, send
                )
                return
        try:
            report = Report.parse(raw)
        except (ValueError, KeyError, TypeError) as exc:
            await error(400, f"a relay's report is not valid: {exc}", "invalid_request_error")(
                scope, receive, send
            )
            return
        if not self.report(gid, report):
            await error(404, f"no open grant {gid[:40]!r}", "invalid_request_error")(
                scope, receive, send
            )
            return
        await Response(status_code=204)(scope, receive, send)


def _grant_id(scope: Scope) -> str:
    query = scope["query_string"].decode("latin-1")
    pairs = (p.partition("=") for p in query.split("&"))
    return next((v for k, _, v in pairs if k == "grant"), "")


class _GrantResponse(Response):
    """The grant, sent at once, then held open until the relay's report is in (then it ends,
    and the relay may use the connection again) or the relay closes the connection."""

    def __init__(self, grants: Grants, gid: str, content: bytes) -> None:
        super().__init__(status_code=200)
        # Set here: Response's own would add a content-length of 0 to an answer that has none.
        self.raw_headers = [(GRANT_HEADER, b"1"), (b"content-type", b"application/octet-stream")]
        self._grants = grants
        self._gid = gid
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self._content, "more_body": True})
            if await before_leaving(self._grants.told(self._gid), receive):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._grants.finish(self._gid)


async def before_leaving(task: asyncio.Future[Any], receive: Receive) -> bool:
    """Wait for `task` or for the client (whose request was read whole) to leave: True if
    `task` is done; False if the client left first (`task` is left to the caller)."""

    async def left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(left())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    return task.done()
