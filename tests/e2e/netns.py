"""Several hosts on this machine: a bridge in the root namespace (the "switch", with the host's
address .1) and one network namespace per host, each with a veth into the bridge and an address
of its own (.10, .11, ...), and its own loopback. Nothing leaves the machine. Needs root (as
CI runs); names are unique per instance, so tests in parallel do not collide."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}; the "
            "cluster tests need root and network namespaces (ip netns), as in CI"
        )


class Hosts:
    """`n` hosts: `address(i)`, `popen(i, argv)` runs a command inside host i, `kill(i)` kills
    every process in it (a host that dies), `close()` removes it all."""

    def __init__(self, n: int) -> None:
        tag = uuid.uuid4().hex[:6]  # interface names: 15 characters at most
        self.bridge = f"cb{tag}"
        self.names = [f"cn{tag}{i}" for i in range(n)]
        octets = uuid.uuid4().bytes
        self.prefix = f"10.{64 + octets[0] % 128}.{octets[1]}"  # a /24 of its own
        self.host_address = f"{self.prefix}.1"
        self._made: list[tuple[str, ...]] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self._made.append(("netns", "del", ns))
                outer, inner = f"cv{tag}{i}", f"cp{tag}{i}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        return f"{self.prefix}.{10 + i}"

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], text=True, **kw)

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.names[i]], capture_output=True, text=True, timeout=30
        ).stdout
        return [int(p) for p in out.split()]

    def kill(self, i: int) -> list[int]:
        """kill -9 everything running in host i (its gateway and model servers): the host
        died. Returns the pids killed."""
        pids = self.pids(i)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def close(self) -> None:
        for i in range(len(self.names)):
            with contextlib.suppress(Exception):
                self.kill(i)
        for args in reversed(self._made):
            with contextlib.suppress(RuntimeError):
                _ip(*args)
        self._made.clear()
