"""Webhook delivery as the careful services do it: only to public addresses unless
`batch.webhook_hosts` names the target, to the very address that was checked, without
redirects, once per batch, from a bounded pool of its own, with a capped read of the answer and
a deadline, signed the Standard Webhooks way.

`check_url` is pure but for DNS (`resolve`); `Deliverer` owns the pool and the in-flight set.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

log = logging.getLogger("corral.batch.webhooks")

MAX_ANSWER_BYTES = 4096  # what is read of a target's answer; the rest is never read
DEADLINE_S = 10.0  # a whole delivery: resolve, connect, send and read the capped answer
POOL = 4  # deliveries at once; a hanging target holds one slot, never another batch's

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class WebhookRefused(ValueError):
    """The URL may not be a webhook target; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class Target:
    """A checked webhook target: the URL to request (the checked address in place of the
    name), and the original host for the Host header and TLS."""

    url: str
    host: str
    address: str


def _internal(a: Address) -> str | None:
    """Why `a` is not a public address, or None."""
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    for attr, what in (
        ("is_loopback", "loopback"),
        ("is_link_local", "link-local (cloud metadata lives there)"),
        ("is_multicast", "multicast"),
        ("is_unspecified", "unspecified"),
        ("is_private", "private"),
        ("is_reserved", "reserved"),
    ):
        if getattr(a, attr):
            return what
    return None


def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (blocking: call it in a thread)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def check_url(
    url: str,
    allowed_hosts: Iterable[str],
    lookup: Callable[[str, int], list[str]] = resolve_host,
) -> Target:
    """Check a webhook URL and pick the address to connect to. With `allowed_hosts` (the
    config's `batch.webhook_hosts`) set, the host must be one of them, and then may be
    anything, a loopback address included. Any other host must resolve only to public
    addresses (every address is checked: one internal answer refuses the URL), and the
    delivery connects to the address checked. Raises `WebhookRefused`."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as exc:  # "http://[": an IPv6 bracket left open
        raise WebhookRefused(f"webhook_url is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise WebhookRefused("webhook_url must be an http(s) URL")
    if parts.username or parts.password:
        raise WebhookRefused("webhook_url must not carry credentials")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise WebhookRefused(f"webhook_url has a bad port: {exc}") from None
    allowed = list(allowed_hosts)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    if allowed:
        if host not in allowed:
            raise WebhookRefused(
                f"webhook host {host!r} is not allowed (batch.webhook_hosts: {', '.join(allowed)})"
            )
        return Target(url, netloc, "")  # named by the operator: trusted, connected by name
    try:
        addresses = lookup(host, port)
    except (OSError, UnicodeError) as exc:
        raise WebhookRefused(f"webhook host {host!r} does not resolve: {exc}") from None
    if not addresses:
        raise WebhookRefused(f"webhook host {host!r} does not resolve")
    for text in addresses:
        a = ipaddress.ip_address(text.split("%")[0])
        why = _internal(a)
        if why is not None:
            raise WebhookRefused(
                f"webhook host {host!r} is {a}, a {why} address: webhooks go to public "
                "addresses unless batch.webhook_hosts names the host"
            )
    address = addresses[0]
    literal = f"[{address}]" if ":" in address else address
    pinned = urlunsplit((parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, ""))
    return Target(pinned, netloc, address)


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The Standard Webhooks signature header value: `v1,<base64 HMAC-SHA256>` over
    `{id}.{timestamp}.{body}`; a `whsec_` secret is base64 (the convention), any other is used
    as its UTF-8 bytes."""
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


Report = Callable[[str, str | None], Awaitable[None]]


class Deliverer:
    """Sends webhooks on a pool of POOL, at most one delivery per batch at a time; `report`
    records each attempt's outcome (None: delivered) on the batch."""

    def __init__(
        self,
        allowed_hosts: Iterable[str],
        report: Report,
        secret: str | None = None,
        deadline_s: float = DEADLINE_S,
    ) -> None:
        self._allowed = list(allowed_hosts)
        self._report = report
        self._secret = secret
        self._deadline_s = deadline_s
        self._slots = asyncio.Semaphore(POOL)
        self._flying: dict[str, asyncio.Task[None]] = {}
        self._client: httpx.AsyncClient | None = None
        self._making = asyncio.Lock()

    async def _http(self) -> httpx.AsyncClient:
        """The client, made at the first delivery and off the loop: its TLS context reads the
        CA bundle (tens of milliseconds)."""
        async with self._making:
            if self._client is None:
                # No redirects (httpx's default, said here), no proxies from the environment.
                self._client = await asyncio.to_thread(
                    httpx.AsyncClient, follow_redirects=False, trust_env=False, timeout=None
                )
        return self._client

    def busy(self, batch_id: str) -> bool:
        return batch_id in self._flying

    def submit(self, batch_id: str, url: str, body: dict[str, Any]) -> None:
        """Deliver in the background, unless this batch's delivery is already under way."""
        if batch_id in self._flying:
            return
        task = asyncio.create_task(self._one(batch_id, url, body))
        self._flying[batch_id] = task
        task.add_done_callback(lambda _t: self._flying.pop(batch_id, None))

    async def _one(self, batch_id: str, url: str, body: dict[str, Any]) -> None:
        async with self._slots:
            try:
                problem = await asyncio.wait_for(self._send(batch_id, url, body), self._deadline_s)
            except TimeoutError:
                problem = f"no answer within {self._deadline_s:g} s"
            except WebhookRefused as exc:
                problem = f"refused: {exc}"
            except (httpx.HTTPError, OSError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
        try:
            await self._report(batch_id, problem)
        except Exception:  # the next tick offers it again
            log.exception("recording the webhook of %s failed", batch_id)

    async def _send(self, batch_id: str, url: str, body: dict[str, Any]) -> str | None:
        # Checked again at send time, on a fresh lookup, and connected to the address checked:
        # a name that resolved to a public address at create time may not now (DNS rebinding).
        target = await asyncio.to_thread(check_url, url, self._allowed)
        payload = json.dumps({"type": f"batch.{body['status']}", "data": body}).encode()
        msg_id = f"{batch_id}.{body['status']}"
        headers = {"host": target.host, "content-type": "application/json", "webhook-id": msg_id}
        if self._secret:
            now = int(time.time())
            headers["webhook-timestamp"] = str(now)
            headers["webhook-signature"] = sign(self._secret, msg_id, now, payload)
        hostname = urlsplit(url).hostname or ""
        client = await self._http()
        request = client.build_request(
            "POST", target.url, content=payload, headers=headers,
            extensions={"sni_hostname": hostname},
        )  # fmt: skip
        response = await client.send(request, stream=True)
        try:
            read = 0
            async for chunk in response.aiter_raw():
                read += len(chunk)
                if read >= MAX_ANSWER_BYTES:
                    break  # the rest is never read: closing drops the connection
        finally:
            await response.aclose()
        return f"HTTP {response.status_code}" if response.status_code >= 300 else None

    async def close(self) -> None:
        for task in list(self._flying.values()):
            task.cancel()
        await asyncio.gather(*self._flying.values(), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
