"""`corral serve --watch`: models added, changed and removed in the config file take
effect under traffic without a restart and without dropping a request; a bad edit keeps the
previous configuration and says what is wrong, with its line."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from corral.backends.process import free_port
from tests.helpers import wait_http_ok
from tests.support.gateway import CORRAL, SIM

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ALPHA = f"  alpha:\n    load_s: 0.2\n    cmd: {SIM} --load-s 0.2 --tokens-per-s 20\n"
BETA = f"  beta:\n    load_s: 0.2\n    cmd: {SIM} --load-s 0.2 --tokens-per-s 20\n"


def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    config = tmp_path / "corral.yaml"
    config.write_text(f"models:\n{ALPHA}server:\n  log_dir: {tmp_path / 'logs'}\n")
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [CORRAL, "serve", "--config", str(config), "--watch", "--listen", f"127.0.0.1:{port}"],
            stderr=err,
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http_ok(f"{url}/health", timeout_s=60)
            yield url, config, log
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def chat(url: str, model: str, tokens: int) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": tokens},
        timeout=60,
    )


def in_background(
    url: str, model: str, tokens: int
) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(chat(url, model, tokens)))
    t.start()
    return t, out


def status(url: str) -> dict[str, dict[str, object]]:
    models: dict[str, dict[str, object]] = httpx.get(f"{url}/api/status").json()["models"]
    return models


def listed(url: str) -> list[str]:
    return sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"])


def test_models_added_changed_and_removed_under_traffic_and_nothing_dropped(
    served: tuple[str, Path, Path],
) -> None:
    url, config, log = served
    assert chat(url, "alpha", 1).status_code == 200
    old_pid = status(url)["alpha"]["pid"]
    # 40 tokens at 20/s: in flight through the edit.
    t, long = in_background(url, "alpha", 40)
    until(lambda: status(url)["alpha"]["in_flight"] == 1, "alpha's long request")
    changed = ALPHA.replace("--tokens-per-s 20", "--tokens-per-s 400")
    config.write_text(f"models:\n{changed}{BETA}server:\n  log_dir: {config.parent / 'logs'}\n")
    until(lambda: "beta" in listed(url), "beta to be added")
    assert chat(url, "beta", 2).status_code == 200  # the new model serves at once
    t.join(60)
    assert long[0].status_code == 200
    assert long[0].json()["usage"]["completion_tokens"] == 40  # not cut by the restart
    fresh = chat(url, "alpha", 2)
    assert fresh.status_code == 200
    new_pid = status(url)["alpha"]["pid"]
    assert new_pid not in (None, old_pid)  # the changed command runs now

    # beta removed while a request of its own is in flight: it finishes, new ones get 404.
    t, last = in_background(url, "beta", 30)
    until(lambda: status(url)["beta"]["in_flight"] == 1, "beta's request")
    config.write_text(f"models:\n{changed}server:\n  log_dir: {config.parent / 'logs'}\n")
    until(lambda: "beta" not in listed(url), "beta to be removed")
    assert chat(url, "beta", 1).status_code == 404
    t.join(60)
    assert last[0].status_code == 200
    assert last[0].json()["usage"]["completion_tokens"] == 30
    until(lambda: "beta" not in status(url), "beta to be gone once idle")

    # A bad edit: nothing changes, and the log says what and where.
    config.write_text(f"models:\n{changed}  broken: [\nserver: {{}}\n")
    until(lambda: "config not reloaded" in log.read_text(), "the reload error")
    text = log.read_text()
    said = text.split("config not reloaded", 1)[1]
    assert re.search(r"corral\.yaml:\d+: not valid YAML", said), said  # the file and its line
    assert chat(url, "alpha", 1).status_code == 200
    assert listed(url) == ["alpha"]
    assert "Traceback" not in text
