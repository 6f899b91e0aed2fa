"""Headless Chromium, driven over WebDriver, for the pages' tests and screenshots.

chromedriver (Debian's `chromium-driver`) speaks the W3C WebDriver protocol: JSON over HTTP on a
local port. This module is a client of the few commands the tests need (open a URL, run a script,
take a screenshot), in the standard library, so no browser package joins the test extra. Chromium
starts headless with a fresh profile and with its background services off: on a closed network
its update, sync and component fetches are refused connections, and it needs none of them.

Where Chromium or chromedriver is missing, `Browser()` raises BrowserMissing with one line that
says how to install them (never a skip: the tests that need a browser fail with it).
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from kvjax.errors import KvjaxError

INSTALL = "apt-get install -y chromium chromium-driver"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--disable-extensions", "--hide-scrollbars", "--force-device-scale-factor=1")


class BrowserMissing(KvjaxError):
    """No headless Chromium or no chromedriver on this machine; the message says how to install them."""


class BrowserError(KvjaxError):
    """WebDriver refused a command, or a page did not reach a state in time."""


def find_browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths: $KVJAX_CHROMIUM / $KVJAX_CHROMEDRIVER, else the PATH's."""
    chromium = shutil.which(os.environ.get("KVJAX_CHROMIUM") or "") or next(filter(None, map(shutil.which,
                                                                                          CHROMIUM_NAMES)), None)
    driver = shutil.which(os.environ.get("KVJAX_CHROMEDRIVER") or "chromedriver")
    if not chromium or not driver:
        missing = " and ".join(n for n, p in (("chromium", chromium), ("chromedriver", driver)) if not p)
        raise BrowserMissing(f"the browser tests need headless Chromium; {missing} not found: {INSTALL} "
                             "(Debian; docs/testing.md)")
    return chromium, driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """One headless Chromium window (width × height CSS pixels); close() ends it (or use `with`)."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 30.0):
        chromium, driver = find_browser()
        self.profile = tempfile.mkdtemp(prefix="kvjax-chromium-")
        self.port = _free_port()
        self.driver = subprocess.Popen([driver, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.session = None
        try:
            end = time.time() + timeout
            while True:
                try:
                    if self._call("GET", "/status", timeout=2)["ready"]:
                        break
                except (OSError, BrowserError):
                    pass
                if time.time() > end or self.driver.poll() is not None:
                    raise BrowserError(f"chromedriver on port {self.port} did not start")
                time.sleep(0.05)
            args = [*FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}"]
            caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "pageLoadStrategy": "normal",
                                                     "goog:chromeOptions": {"binary": chromium, "args": args}}}}
            self.session = self._call("POST", "/session", caps, timeout=timeout)["sessionId"]
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())["value"]
        except urllib.error.HTTPError as e:
            value = json.loads(e.read() or b"{}").get("value", {})
            raise BrowserError(f"WebDriver {method} {path}: {value.get('error')}: "
                               f"{str(value.get('message', ''))[:500]}") from None

    def _session(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Any:
        return self._call(method, f"/session/{self.session}{path}", body, timeout)

    def get(self, url: str) -> None:
        """Open url and wait for its load event."""
        self._session("POST", "/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """Run a function body in the page (`arguments` holds args) and return its JSON result."""
        return self._session("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait(self, script: str, *args: Any, timeout: float = 30.0, what: str = "") -> Any:
        """Run script until it returns something truthy; that value. BrowserError after timeout."""
        end = time.time() + timeout
        while True:
            value = self.run(script, *args)
            if value:
                return value
            if time.time() > end:
                raise BrowserError(f"the page did not reach {what or script!r} in {timeout:g} s")
            time.sleep(0.05)

    def resize(self, width: int, height: int) -> None:
        """The window's size in CSS pixels (the next screenshot's)."""
        self._session("POST", "/window/rect", {"width": width, "height": height})

    def screenshot(self, path: str | os.PathLike) -> None:
        """The window as a PNG file."""
        png = base64.b64decode(self._session("GET", "/screenshot"))
        with open(path, "wb") as f:
            f.write(png)

    def close(self) -> None:
        if self.session is not None:
            try:
                self._session("DELETE", "", timeout=10)
            except (OSError, BrowserError):
                pass
            self.session = None
        if self.driver.poll() is None:
            self.driver.terminate()
            try:
                self.driver.wait(10)
            except subprocess.TimeoutExpired:
                self.driver.kill()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def install() -> int:
    """`python -m kvjax.testing.browser install`, the README's test command's first step: nothing where Chromium and
    chromedriver are found; else Debian's packages through apt-get (with sudo unless root). → exit status: 0 once
    both are found, or where apt-get is absent (the browser tests then fail with find_browser's line), 1 where
    apt-get ran and they are still missing."""
    try:
        print("browser: {} and {}".format(*find_browser()))
        return 0
    except BrowserMissing as e:
        if shutil.which("apt-get") is None:
            print(f"warning: {e}")
            return 0
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]):
        if subprocess.run(sudo + cmd, env=env).returncode != 0:
            print(f"error: `{' '.join(sudo + cmd)}` failed; the browser tests need {INSTALL}")
            return 1
    try:
        print("browser: {} and {}".format(*find_browser()))
        return 0
    except BrowserMissing as e:
        print(f"error: {e}")
        return 1


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m kvjax.testing.browser install")
    sys.exit(install())
