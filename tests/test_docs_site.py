"""The docs site builds in strict mode (a broken link, a missing page or anchor fails it) and renders in a
real browser, search included.

The build runs on a copy of mkdocs.yml and docs/ (scripts/gen-docs.py writes the generated reference pages
into the copy), so the test leaves the working tree alone. mkdocs is a dev extra: without it the tests skip
locally and fail under CI=true (tests/conftest.py). Material's search fetches its index
(search/search_index.json) from the site, which a browser refuses for file:// pages: the browser test serves
the built site on a loopback port, as `mkdocs serve` or any static server does, and searches there.
"""

from __future__ import annotations

import functools
import os
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_site(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "mkdocs.yml", dest / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", dest / "docs")
    return dest


def _build(src: Path, out: Path) -> subprocess.CompletedProcess:
    gen = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-docs.py"), "--docs-dir", str(src / "docs")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert gen.returncode == 0, gen.stderr[-3000:]
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(src / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, timeout=300, cwd=src,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory, require_module) -> Path:
    require_module("mkdocs", "material")
    src = _copy_site(tmp_path_factory.mktemp("docs-src"))
    out = tmp_path_factory.mktemp("site")
    r = _build(src, out)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stderr[-4000:]}"
    return out


def test_site_builds_strict_with_every_page(site):
    for page in ("index.html", "getting-started.html", "reference/commands.html", "reference/config.html",
                 "reference/api.html", "reference/tables.html", "benchmarks.html", "how-to/land-rollouts.html",
                 "search/search_index.json"):
        assert (site / page).is_file(), page
    commands = (site / "reference" / "commands.html").read_text()
    assert "pipeline demo" in commands and "pipeline jobs render-k8s" in commands   # walked from the parser
    assert "max_policy_lag" in (site / "reference" / "config.html").read_text()
    assert "ingest_table" in (site / "reference" / "api.html").read_text()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text(), "the site fetches fonts from outside"


def test_strict_build_fails_on_a_broken_link(tmp_path, require_module):
    """The strict build is what catches a broken link: the same build of a page with one fails."""
    require_module("mkdocs", "material")
    src = _copy_site(tmp_path / "src")
    index = src / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    r = _build(src, tmp_path / "out")
    assert r.returncode != 0 and "no-such-page.md" in r.stderr, r.stderr[-3000:]


# -- headless Chromium over the DevTools protocol ---------------------------------------------------------

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
         "--no-first-run", "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0"]


class _Served:
    """The built site on 127.0.0.1 (a free port), recording every path the browser asked for."""

    def __init__(self, root: Path):
        self.paths: list[str] = []
        served = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                served.paths.append(self.path)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


_IDS = iter(range(1, 10**9))   # DevTools message ids


def _evaluate(ws, expression: str) -> object:
    n = next(_IDS)
    ws.send(json.dumps({"id": n, "method": "Runtime.evaluate",
                        "params": {"expression": expression, "returnByValue": True}}))
    while True:
        reply = json.loads(ws.recv(timeout=30))
        if reply.get("id") == n:
            return reply["result"]["result"].get("value")


def _poll(ws, expression: str, until, timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = _evaluate(ws, expression)
        if until(value):
            return value
        time.sleep(0.25)
    return value


STATE = """JSON.stringify({
  title: document.title,
  h1: (document.querySelector('.md-content h1') || {}).textContent || '',
  header: document.querySelector('.md-header') ? getComputedStyle(document.querySelector('.md-header')).position : '',
  nav: document.querySelectorAll('.md-nav__link').length,
  results: Array.from(document.querySelectorAll('.md-search-result__item a')).map(a => a.getAttribute('href')),
  meta: ((document.querySelector('.md-search-result__meta') || {}).textContent || '').trim()
})"""


@pytest.mark.slow
@pytest.mark.chromium
def test_site_renders_and_searches_offline_in_headless_chromium(site, tmp_path, chromium_bin, require_module):
    require_module("websockets")
    from websockets.sync.client import connect

    served = _Served(site)
    browser = subprocess.Popen([chromium_bin, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                                "--remote-debugging-port=0", f"{served.url}/index.html?q=snapshot"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    try:
        port = None
        for line in browser.stderr:  # type: ignore[union-attr]
            log.append(line)
            if m := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                port = int(m.group(1))
                break
        assert port, "".join(log)[-3000:]
        threading.Thread(target=lambda: log.extend(browser.stderr), daemon=True).start()  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        pages: list[dict] = []
        while not pages and time.monotonic() < deadline:
            pages = [t for t in json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10))
                     if t["type"] == "page"]
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as ws:
            state = json.loads(_poll(ws, STATE, lambda v: v and json.loads(v)["results"]))  # type: ignore[arg-type]
    finally:
        browser.terminate()
        browser.wait(timeout=30)
        served.close()
    # rendered: the page, Material's stylesheet (its sticky header) and the whole navigation
    assert state["title"] == "The trajectory lakehouse" and state["h1"].startswith("The trajectory lakehouse")
    assert state["header"] == "sticky", "Material's stylesheet did not apply"
    assert state["nav"] >= 30
    # search: the index came from the site itself, and the query found the snapshot pages
    assert "/search/search_index.json" in served.paths
    assert state["results"], f"no search results: {state['meta']!r}"
    assert any("snapshots" in href for href in state["results"]), state["results"]
    errors = [ln for ln in log if "Uncaught" in ln or "ERROR:CONSOLE" in ln or "net::ERR_" in ln]
    assert errors == [], errors


def test_exit_code_table_lists_every_exit_code_the_code_defines():
    """docs/reference/cli.md's exit-code table has one row per EXIT_* constant of the package, no more."""
    defined = {}
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for m in re.finditer(r"^(EXIT_[A-Z_]+) = (\d+)", path.read_text(), re.M):
            defined.setdefault(int(m.group(2)), []).append(m.group(1))
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    table = page.split("| code | meaning |", 1)[1].split("\n\n", 1)[0]
    documented = {int(c) for c in re.findall(r"^\| (\d+) \|", table, re.M)}
    assert len(defined) >= 8, defined
    assert documented == set(defined), (f"undocumented: {set(defined) - documented}, "
                                        f"documented but not defined: {documented - set(defined)}")
