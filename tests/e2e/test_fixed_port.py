"""A model server on a fixed port runs once (devices, live): when it is unloaded from
one device while that device is still busy with another model's load (so its stop waits its
turn there), and a request brings it back on the other device, its server starts again only
after the old one has stopped. Before, a second server was started on the port the first still
held, and the request failed."""

from __future__ import annotations

import threading

import httpx
import pytest

from corral.backends.process import free_port
from tests.helpers import alive
from tests.support.gateway import CORRAL, SIM, serve, wait_for

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(120)
def test_a_fixed_port_server_comes_back_elsewhere_only_after_its_stop(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    port = free_port()
    config = f"""
models:
  fixed:
    load_s: 0.3
    memory_gb: 10
    cmd: {CORRAL} sim-backend --model fixed --port {port} --load-s 0.3 --unload-s 0.2
    proxy: http://127.0.0.1:{port}
  slow:
    load_s: 3
    memory_gb: 10
    cmd: {SIM} --load-s 3
devices:
  - {{name: gpu0, memory_gb: 20}}
  - {{name: gpu1, memory_gb: 20}}
server:
  log_dir: LOG_DIR
"""
    with serve(tmp_path_factory.mktemp("fixed"), config) as gw:
        c = gw.client(max_retries=0)
        assert c.completions.create(model="fixed", prompt="hi", max_tokens=2).choices[0].text
        first = gw.status()["models"]["fixed"]
        assert first["device"] == "gpu0"

        # slow loads beside fixed on gpu0 for 3 s (free room there comes first)...
        answers: list[str] = []
        slow = threading.Thread(
            target=lambda: answers.append(
                c.completions.create(model="slow", prompt="x", max_tokens=2).choices[0].text
            )
        )
        slow.start()
        wait_for(lambda: gw.status()["models"]["slow"]["state"] == "loading")
        assert gw.status()["models"]["slow"]["device"] == "gpu0"
        # ...meanwhile fixed is unloaded (its stop waits for gpu0's load) and asked for again:
        # gpu0 is mid-swap, so it comes back on gpu1.
        assert httpx.post(f"{gw.url}/api/models/unload/fixed").status_code == 200
        again = c.completions.create(model="fixed", prompt="again", max_tokens=2)
        assert again.choices[0].text
        slow.join(timeout=30)
        assert len(answers) == 1
        assert answers[0]

        now = gw.status()["models"]["fixed"]
        assert now["device"] == "gpu1"
        assert now["pid"] != first["pid"]
        assert not alive(first["pid"])  # the old server was stopped before the new one began
        assert alive(now["pid"])
        assert gw.status()["swaps"] == 3  # fixed, slow, fixed again: no failed start between
