"""GET /dashboard in a real headless Chromium (Debian's `chromium`), against a real proxy and sim workers.

The page loads without a console error, lists every live worker, and a worker's KV bar moves
when load arrives. A screenshot under load is saved as a test artifact (KVROUTE_ARTIFACTS, default
./.artifacts/); KVROUTE_UPDATE_DOCS=1 also writes it to docs/dashboard.png for the README.
A missing Chromium fails this test: `make system-deps` installs it.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import httpx

from tests.observability.cdp import Browser
from tests.proxy.fleet import Fleet
from tests.support.procs import REPO, wait_until

MODEL = "qwen3-vl-demo"
KV_TOKENS = 8192  # small KV, so a handful of long requests fills a visible part of it


def _artifact_dir() -> Path:
    return Path(os.environ.get("KVROUTE_ARTIFACTS", REPO / ".artifacts"))


class Load:
    """Long streaming chat requests from a few threads until stopped: enough to fill the sims' KV."""

    def __init__(self, url: str, threads: int = 8) -> None:
        self.url, self.stop = url, threading.Event()
        self.done = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=60.0) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                prompt = f"request {i}-{n}: " + " ".join(f"word{j}" for j in range(250))  # ~1000 tokens
                with client.stream("POST", self.url + "/v1/chat/completions", json={
                        "model": MODEL, "stream": True, "max_tokens": 800,
                        "messages": [{"role": "user", "content": prompt}]}) as resp:
                    assert resp.status_code == 200, resp.read()
                    for _ in resp.iter_bytes():
                        if self.stop.is_set():
                            break
                self.done += 1


def _kv_values(browser: Browser) -> dict[str, float]:
    return browser.evaluate("""Object.fromEntries([...document.querySelectorAll('tr[data-worker-id]')]
        .map(r => [r.dataset.workerId, Number((r.querySelector('.kvbar') || {dataset: {kv: -1}}).dataset.kv)]))""")


def test_dashboard_in_chromium_lists_workers_and_shows_kv_under_load(procs, tmp_path):
    fleet = Fleet(procs, tmp_path)
    try:
        fleet.start_proxy()
        sims = fleet.start_sims(3, model=MODEL, time_scale=0.5, kv_capacity_tokens=KV_TOKENS)
        ids = {s.worker_id for s in sims}
        browser = Browser(procs, tmp_path / "chromium-profile")
        try:
            browser.open(fleet.url + "/dashboard")
            listed = wait_until(lambda: (lambda rows: rows if ids <= set(rows) else None)(_kv_values(browser)),
                                20.0, 0.2, "every worker listed on the page")
            assert set(listed) == ids
            states = browser.evaluate("[...document.querySelectorAll('tr[data-worker-id]')].map(r => r.dataset.state)")
            assert states == ["ready"] * len(ids)
            assert browser.evaluate("document.getElementById('conn').textContent") == "live"
            idle = _kv_values(browser)

            with Load(fleet.url):
                busy = wait_until(lambda: (lambda kv: kv if max(kv.values()) >= 0.2 else None)(_kv_values(browser)),
                                  60.0, 0.2, "a KV bar to rise under load")
                assert max(busy.values()) > max(idle.values())
                # the model row shows the traffic too (requests finish over the load's first seconds)
                wait_until(lambda: browser.evaluate(
                    f"Number(document.querySelector('tr[data-model=\"{MODEL}\"] td:nth-child(3)').textContent) > 0"),
                    30.0, 0.2, "the model's req/s to show traffic")
                shot = browser.screenshot(_artifact_dir() / "dashboard-under-load.png")
            assert shot.stat().st_size > 10_000
            if os.environ.get("KVROUTE_UPDATE_DOCS") == "1":
                shutil.copyfile(shot, REPO / "docs" / "dashboard.png")

            browser.pump()
            assert browser.console_errors == []
        finally:
            browser.close()
    finally:
        fleet.close()
