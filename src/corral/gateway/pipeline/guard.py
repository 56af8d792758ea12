"""The front door's first check, before keys and routes: which Host a request may
name (DNS rebinding), and which cross-site requests may change anything (CSRF).

Without API keys (the default), anything a browser can be made to send is a request from
the machine's own user. Two attacks follow, and both are refused here:
- **DNS rebinding**: a page at attacker.example, whose name then resolves to 127.0.0.1,
  reads `/logs` and `/api/status` same-origin. Its Host header still names attacker.example,
  so only Hosts that are IP literals (a name cannot be rebound), `localhost`, or
  `server.allowed_hosts` are answered (Vite's rule).
- **Cross-site requests**: a page elsewhere POSTs `text/plain` to /v1/chat/completions (a
  "simple" request, sent without a preflight) or loads `<img src=".../unload">`. Browsers mark
  them: `Origin` on every cross-origin POST, `Sec-Fetch-Site` on every request. A request that
  changes state (any method but GET, HEAD and OPTIONS; `/unload` and `/upstream/...` also on
  GET) is refused when its `Origin` names another host than its Host (and not one of
  `allowed_hosts`), or, with no `Origin`, when `Sec-Fetch-Site` says another site sent it.
  Clients that are not browsers send neither header and are never refused here.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from corral.gateway.errors import error

_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_LOCAL = frozenset({"localhost", "localhost."})


def _hostname(host_port: str) -> str:
    """`host[:port]` (a Host header or an Origin's netloc) without the port, lowercase."""
    if host_port.startswith("["):
        return host_port[1 : host_port.find("]")].lower()
    return host_port.rsplit(":", 1)[0].lower() if host_port.count(":") == 1 else host_port.lower()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _changes_state(method: str, path: str) -> bool:
    return method not in _SAFE or path == "/unload" or path.startswith("/upstream/")


class Guard:
    """Pure ASGI middleware; `allowed_hosts`: `server.allowed_hosts` ("*" allows any Host)."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed = frozenset(h.lower() for h in allowed_hosts)
        self._hosts: dict[bytes, bool] = {}  # Host header -> answered (the hot path's cache)

    def host_allowed(self, name: str) -> bool:
        return self.any_host or name in _LOCAL or name in self.allowed or _is_ip(name)

    def _host_ok(self, host: bytes) -> bool:
        ok = self._hosts.get(host)
        if ok is None:
            ok = self.host_allowed(_hostname(host.decode("latin-1")))
            if len(self._hosts) < 1024:  # bounded: a client may send any Host
                self._hosts[host] = ok
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = origin = fetch_site = b""
        for k, v in scope["headers"]:
            if k == b"host":
                host = v
            elif k == b"origin":
                origin = v
            elif k == b"sec-fetch-site":
                fetch_site = v
        host_text = host.decode("latin-1")
        if host and not self._host_ok(host):
            response = error(
                403,
                f"Host {host_text!r} is not served: only IP addresses, localhost and "
                "server.allowed_hosts are (a guard against DNS rebinding); add the name to "
                "server.allowed_hosts to serve it",
                "permission_error",
                code="host_not_allowed",
            )
            await response(scope, receive, send)
            return
        if (origin or fetch_site) and _changes_state(scope["method"], scope["path"]):
            refused = ""
            if origin:
                o = origin.decode("latin-1")
                netloc = urlsplit(o).netloc if o != "null" else ""
                same = netloc != "" and netloc.lower() == host_text.lower()
                # Named origins only: an IP literal or localhost is a Host we answer, not a
                # site we trust (a page at http://203.0.113.9 is still another site).
                if not same and _hostname(netloc) not in self.allowed:
                    refused = f"from origin {o!r}"
            elif fetch_site in (b"cross-site", b"same-site"):
                refused = f"sent by another site (Sec-Fetch-Site: {fetch_site.decode()})"
            if refused:
                response = error(
                    403,
                    f"cross-site request refused: {scope['method']} {scope['path']} {refused}; "
                    "a page on another site may not make Corral act (add its host to "
                    "server.allowed_hosts to allow it)",
                    "permission_error",
                    code="cross_site_refused",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
