"""The chat page of `vlmctl serve` in a real headless browser (Debian's chromium through selenium, no browser
download): load it, upload an image, see the streamed answer, ask a follow-up with the history, reset. Skipped
where chromium, chromedriver or selenium is missing."""

from __future__ import annotations

import base64
import io
import json
import shutil
import urllib.request
from pathlib import Path

import pytest

selenium = pytest.importorskip("selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")

TEXTS = ["What color is the square?", "And its shape?", "red blue green square"]


def png(rgb, size=32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


def completion(url: str, messages: list[dict]) -> str:
    body = json.dumps({"model": "tiny", "messages": messages}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def test_the_chat_page_streams_answers_keeps_history_and_resets(tmp_path: Path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from vlmctl.config import ModelSection
    from vlmctl.inference import load_for_generation
    from vlmctl.models.build import build_model
    from vlmctl.serve import ServeSettings, running_server

    folder = tmp_path / "tiny"
    build_model(ModelSection(preset="tiny", init="random", output_dir=folder, dtype="fp32"), tokenizer_texts=TEXTS * 5)
    image = png((220, 30, 30))
    (tmp_path / "red.png").write_bytes(image)
    model, processor = load_for_generation(folder, device="cpu", dtype="fp32")
    with running_server(model, processor, ServeSettings(port=0), name="tiny") as url:
        image_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}
        first = [{"role": "user", "content": [image_part, {"type": "text", "text": TEXTS[0]}]}]
        expected = completion(url, first)
        follow_up = [*first, {"role": "assistant", "content": expected}, {"role": "user", "content": [{"type": "text", "text": TEXTS[1]}]}]
        expected_second = completion(url, follow_up)

        wait = WebDriverWait(browser, 120)
        browser.get(url + "/")
        wait.until(lambda d: d.find_element(By.ID, "model").text == "tiny")
        browser.find_element(By.ID, "image").send_keys(str(tmp_path / "red.png"))
        browser.find_element(By.ID, "prompt").send_keys(TEXTS[0])
        browser.find_element(By.ID, "send").click()

        def answers(d):
            done = d.find_element(By.ID, "status").text == "" and d.find_element(By.ID, "send").is_enabled()
            return done and [e.text for e in d.find_elements(By.CSS_SELECTOR, ".turn.assistant .text")]

        assert wait.until(lambda d: (a := answers(d)) and len(a) == 1 and a) == [expected]
        assert browser.find_elements(By.CSS_SELECTOR, ".turn.user img")  # the uploaded picture is shown
        assert not browser.find_elements(By.CSS_SELECTOR, ".turn.error")
        browser.find_element(By.ID, "prompt").send_keys(TEXTS[1])
        browser.find_element(By.ID, "send").click()
        assert wait.until(lambda d: (a := answers(d)) and len(a) == 2 and a) == [expected, expected_second]
        browser.find_element(By.ID, "reset").click()
        assert browser.find_elements(By.CSS_SELECTOR, ".turn") == []
        assert browser.execute_script("return conversation.length") == 0
