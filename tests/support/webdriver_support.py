"""A headless Chromium driven through chromedriver's W3C WebDriver HTTP API (loopback only), for tests that click.

    with Browser() as browser:
        browser.open(url)
        browser.click("#next")
        browser.run("return document.title")

Debian's `chromium` and `chromium-driver` packages; no Python client library: the protocol is a few JSON calls.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from support.ports import free_port

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900"]


def driver_binaries() -> tuple[str, str] | None:
    """(chromium, chromedriver) paths, or None where either is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class Browser:
    def __init__(self, timeout: float = 60.0):
        found = driver_binaries()
        if found is None:
            raise FileNotFoundError("chromium and chromedriver")
        self.chromium, driver = found
        self.timeout = timeout
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="view-webdriver-")
        self.process = subprocess.Popen([driver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.session = None

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"webdriver {method} {path}: {error.read()[:500]!r}") from None

    def __enter__(self) -> Browser:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if self._call("GET", "/status").get("ready"):
                    break
            except (OSError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("chromedriver did not start")
            time.sleep(0.1)
        options = {"binary": self.chromium, "args": [*CHROMIUM_ARGS, f"--user-data-dir={self.profile}"]}
        created = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {"goog:chromeOptions": options}}})
        self.session = created["sessionId"]
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.session is not None:
                self._call("DELETE", f"/session/{self.session}")
        finally:
            self.process.terminate()
            self.process.wait(timeout=30)
            shutil.rmtree(self.profile, ignore_errors=True)

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def run(self, script: str, *args):
        """Run `script` (a function body; `return` gives the value) in the page."""
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": list(args)})

    def find(self, css: str) -> str:
        found = self._call("POST", f"/session/{self.session}/element", {"using": "css selector", "value": css})
        return found[ELEMENT]

    def click(self, css: str) -> None:
        self._call("POST", f"/session/{self.session}/element/{self.find(css)}/click", {})

    def type(self, css: str, text: str) -> None:
        self._call("POST", f"/session/{self.session}/element/{self.find(css)}/value", {"text": text})

    def wait_for(self, script: str, timeout: float = 20.0):
        """Poll `script` until it returns a truthy value; that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.run(script)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for: {script}")
            time.sleep(0.1)
