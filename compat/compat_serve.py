"""`corral serve` for the compat tests: started on a free port with its data in a folder of
the test's, its URL yielded once it answers, stopped after."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import wait_http_ok
from tests.support.gateway import CORRAL

from corral.backends.process import free_port


@contextlib.contextmanager
def corral_serve(args: list[str], home: Path) -> Iterator[str]:
    """`corral serve ARGS` (its data under `home`), its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [CORRAL, "serve", *args, "--listen", f"127.0.0.1:{port}"],
        env={**os.environ, "XDG_DATA_HOME": str(home / "data")},
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(60)
