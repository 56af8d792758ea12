"""The dashboard at /ui in a real headless browser (Debian's chromium through its chromedriver;
nothing is downloaded): submit a file through the form, watch the batch reach 100%, cancel
another, and look at the overview. Screenshots go to artifacts/screenshots/."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.batches import chat_line, upload
from tests.support.gateway import SIM, Gateway, serve

ARTIFACTS = Path(os.environ.get("CORRAL_ARTIFACTS", Path(__file__).parents[2] / "artifacts"))
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

CONFIG = f"""
models:
  alpha:
    load_s: 0.3
    concurrency: 4
    # A prompt cache per slot and llama-server's slot API: Corral keeps its caches.
    cmd: {SIM} --load-s 0.3 --tokens-per-s 200 --parallel 4 --prefill-tok-s 100000
    prompt_cache: true
  slow:
    load_s: 0.3
    cmd: {SIM} --load-s 0.3 --tokens-per-s 10
server:
  log_dir: LOG_DIR
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with serve(tmp_path_factory.mktemp("dashboard"), CONFIG) as g:
        yield g


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    missing = [p for p in (CHROMIUM, DRIVER) if not Path(p).exists()]
    assert not missing, (
        f"missing {', '.join(missing)}: the dashboard test needs Debian's chromium and "
        "chromium-driver (apt-get install chromium chromium-driver; make test installs them)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1300,900",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, name: str) -> None:
    folder = ARTIFACTS / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(folder / f"{name}.png"))


def submit(driver: WebDriver, gw: Gateway, path: Path, model: str) -> str:
    driver.get(f"{gw.url}/ui#submit")
    wait = WebDriverWait(driver, 20)
    wait.until(lambda d: len(Select(d.find_element(By.ID, "submit-model")).options) > 1)
    driver.find_element(By.ID, "submit-file").send_keys(str(path))
    Select(driver.find_element(By.ID, "submit-model")).select_by_value(model)
    driver.find_element(By.ID, "submit-button").click()
    # On success the page moves to the batch list (the result line stays in the hidden form).
    wait.until(lambda d: d.execute_script("return location.hash") == "#batches")
    text = driver.find_element(By.ID, "submit-result").get_attribute("textContent") or ""
    assert "created" in text, text
    return text.split()[1]


def row(driver: WebDriver, batch_id: str) -> dict[str, str]:
    """The batch's row as text, read in one go (the list is redrawn live)."""
    cells = driver.execute_script(
        "const tr = document.querySelector(`tr[data-id='${arguments[0]}']`);"
        "return tr ? [...tr.cells].map(c => c.textContent) : null;",
        batch_id,
    )
    if not cells:
        return {"status": "", "progress": "", "files": ""}
    return {"status": cells[1], "progress": cells[2], "files": cells[8]}


def click_cancel(driver: WebDriver, batch_id: str) -> None:
    """Click the batch's cancel button, found and clicked in one script: the list is redrawn
    live, so a button found in one call may be stale at the next (a busy machine redraws
    between them for seconds on end)."""
    clicked = (
        "const b = document.querySelector(`tr[data-id='${arguments[0]}'] button.cancel`);"
        "if (b) b.click(); return !!b;"
    )
    WebDriverWait(driver, 30, poll_frequency=0.2).until(
        lambda d: d.execute_script(clicked, batch_id), f"no cancel button for {batch_id}"
    )


def test_submit_a_file_watch_it_finish_and_cancel_another(
    gw: Gateway, browser: WebDriver, tmp_path: Path
) -> None:
    fast = tmp_path / "fast.jsonl"
    fast.write_text("\n".join(chat_line(i, "as-in-file", tokens=5) for i in range(40)) + "\n")
    batch_id = submit(browser, gw, fast, "alpha")
    wait = WebDriverWait(browser, 60, poll_frequency=0.2)
    wait.until(lambda d: row(d, batch_id)["status"] == "completed")
    got = row(browser, batch_id)
    assert got["progress"].strip() == "100%"
    assert "output" in got["files"]
    shot(browser, "batches-completed")

    slow = tmp_path / "slow.jsonl"
    slow.write_text("\n".join(chat_line(i, "as-in-file", tokens=5) for i in range(40)) + "\n")
    slow_id = submit(browser, gw, slow, "slow")
    wait.until(lambda d: row(d, slow_id)["status"] == "in_progress")
    shot(browser, "batches-in-progress")
    click_cancel(browser, slow_id)
    wait.until(lambda d: row(d, slow_id)["status"] == "cancelled")
    assert "errors" in row(browser, slow_id)["files"]  # the lines that never ran are reported
    shot(browser, "batches-cancelled")

    browser.get(f"{gw.url}/ui#overview")
    # Both models listed, in whatever state: on a busy machine the cancel can come while slow
    # still loads, and that load is aborted (nobody waits for it), so nothing need be ready.
    wait.until(lambda d: {"alpha", "slow"} <= set(d.find_element(By.ID, "models").text.split()))
    models = browser.find_element(By.ID, "models").text
    assert "alpha" in models
    assert "slow" in models
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline rect")  # the swaps, drawn
    shot(browser, "overview")


def test_overview_shows_classes_live_batches_labelled_swaps_and_past_events(
    gw: Gateway, browser: WebDriver
) -> None:
    client = gw.client()
    slow = [chat_line(i, "slow", tokens=5) for i in range(60)]
    running = client.batches.create(
        input_file_id=upload(client, slow), endpoint="/v1/chat/completions", completion_window="24h"
    )
    bad = client.batches.create(
        input_file_id=upload(client, ["not json", chat_line(2, "nope")]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert bad.status == "failed"
    status = gw.status()
    assert set(status["queued_by_class"]) == {"interactive", "batch"}
    assert [b["id"] for b in status["batches"]] == [running.id]
    (live,) = status["batches"]
    assert live["models"] == {"slow": 60}
    assert live["eta_s"] is not None
    assert live["eta_s"] > 0

    browser.get("about:blank")  # a fresh page (not a hash change): events from before it show
    browser.get(f"{gw.url}/ui#overview")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    wait.until(lambda d: "load " in d.find_element(By.ID, "log").text)
    wait.until(lambda d: running.id in d.find_element(By.ID, "live-batches").text)
    live_row = browser.find_element(By.ID, "live-batches").text
    assert " s" in live_row or "min" in live_row  # an ETA
    header = browser.find_element(By.CSS_SELECTOR, "#models thead").text
    assert "interactive queued" in header
    assert "batch queued" in header
    assert "saved prompts" in header
    models = {
        r.text.split()[0]: r.text
        for r in browser.find_elements(By.CSS_SELECTOR, "#models tbody tr")
    }
    assert "restored" in models["alpha"]  # its saved states' figures
    assert "kept" in models["alpha"]  # and whether its restores are honoured
    assert "tokens spared" in models["alpha"]
    assert " off " in f" {models['slow']} "  # a model that keeps none
    prepared = browser.find_element(By.ID, "prepared").text  # what is prepared
    assert "Prepared next" in prepared
    assert "hits" in prepared
    assert "misses" in prepared
    labels = browser.execute_script(
        "return [...document.querySelectorAll('#timeline .swap-label')].map(t => t.textContent)"
    )
    assert {"alpha", "slow"} & set(labels), labels
    assert "-10 min" in browser.find_element(By.ID, "timeline").text
    shot(browser, "overview-live-batches")

    browser.get(f"{gw.url}/ui#batches")
    wait.until(lambda d: "not run" in row(d, bad.id)["progress"])
    problems = row(browser, bad.id)["progress"]
    assert "2 problems" in problems
    assert "line 1" in problems
    assert "100%" not in problems
    shot(browser, "batches-failed-validation")
    client.batches.cancel(running.id)


def test_the_activity_view_lists_recent_requests_with_waits_and_tokens(
    gw: Gateway, browser: WebDriver
) -> None:
    client = gw.client()
    client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    for _ in client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    ):
        pass
    streamed, whole = [a for a in gw.status()["activity"] if a["model"] == "alpha"][:2]
    assert (whole["tokens"], streamed["tokens"]) == (3, 4)  # usage; the stream's text pieces
    assert whole["route"] == streamed["route"] == "/v1/chat/completions"
    assert whole["status"] == streamed["status"] == 200
    assert streamed["first_byte_s"] <= streamed["duration_s"]
    assert whole["first_byte_s"] is None  # a whole answer has no first byte apart from its last
    assert streamed["tokens_per_s"] > 0

    browser.get("about:blank")  # a fresh page, not a hash change of the one already open
    browser.get(f"{gw.url}/ui#overview")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    rows = "#activity tbody tr"
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, rows)) >= 2)
    newest = browser.find_element(By.CSS_SELECTOR, rows).text
    assert "alpha /v1/chat/completions 200" in newest
    assert newest.split()[-2] == "4"  # its tokens
    header = browser.find_element(By.CSS_SELECTOR, "#activity thead").text
    assert "swaps waited" in header
    assert "tokens/s" in header
    shot(browser, "overview-activity")


def test_the_usage_page_shows_each_principals_calls_tokens_and_device_time(
    gw: Gateway, browser: WebDriver
) -> None:
    answer = gw.client().chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.usage is not None
    total = httpx.get(f"{gw.url}/api/usage", params={"by": "total"}, timeout=30).json()["data"]
    (alpha,) = [u for u in total if u["model"] == "alpha"]
    assert alpha["principal"] == "anyone"  # no keys: everyone is one principal
    browser.get("about:blank")
    browser.get(f"{gw.url}/ui#usage")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    rows = "#usage-list tbody tr"
    wait.until(lambda d: any("alpha" in r.text for r in d.find_elements(By.CSS_SELECTOR, rows)))
    (shown,) = [r.text for r in browser.find_elements(By.CSS_SELECTOR, rows) if "alpha" in r.text]
    cells = shown.split()
    assert cells[cells.index("anyone") + 1] == "alpha"
    assert int(cells[cells.index("alpha") + 1].replace(",", "")) >= alpha["requests"]
    Select(browser.find_element(By.ID, "usage-by")).select_by_value("hour")
    wait.until(lambda d: "since start" not in d.find_element(By.CSS_SELECTOR, rows).text)
    shot(browser, "usage")
