"""GET /dashboard in a real headless Chromium (Debian's `chromium`), against a real proxy and sim workers.

The page loads without a console error, lists every live worker, and a worker's KV bar moves
when load arrives. A screenshot under load is saved as a test artifact (KVROUTE_ARTIFACTS, default
./.artifacts/), never into the repository (no picture is tracked).
A missing Chromium fails this test: `make system-deps` installs it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import httpx
from aiohttp import web

from proxy.api import dashboard
from proxy.observability.metrics import ProxyMetrics
from proxy.protocol import WorkerRegistration
from proxy.workers.registry import Registry
from tests.observability.cdp import Browser
from tests.support.fleet import Fleet
from tests.support.procs import REPO, admin_headers, free_port, wait_until

MODEL = "qwen3-vl-demo"
KV_TOKENS = 8192  # small KV, so a handful of long requests fills a visible part of it


def _artifact_dir() -> Path:
    return Path(os.environ.get("KVROUTE_ARTIFACTS", REPO / ".artifacts"))


class Load:
    """Long streaming chat requests from a few threads until stopped: enough to fill the sims' KV."""

    def __init__(self, url: str, threads: int = 8, model: str = MODEL) -> None:
        self.url, self.model, self.stop = url, model, threading.Event()
        self.done = self.failed = 0
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
                        "model": self.model, "stream": True, "max_tokens": 800,
                        "messages": [{"role": "user", "content": prompt}]}) as resp:
                    if resp.status_code != 200:  # e.g. 429 while every worker is past the KV high-water mark
                        self.failed += 1
                        resp.read()
                        self.stop.wait(0.2)
                        continue
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

            # Admin actions only with the admin token (the one `kvroute proxy` made, on loopback too);
            # drain goes through POST /workers/{id}/drain.
            visible_drains = "[...document.querySelectorAll('button[data-drain]')].filter(b => b.offsetParent).length"
            assert browser.evaluate(visible_drains) == 0
            token = fleet.admin()["Authorization"].removeprefix("Bearer ")
            browser.evaluate(f"window.confirm = () => true; useToken('{token}')")
            wait_until(lambda: browser.evaluate(visible_drains) == len(ids), 10, 0.1, "drain buttons with the token")
            browser.evaluate("document.querySelector('button[data-drain=\"sim-2\"]').click()")
            wait_until(lambda: browser.evaluate(
                "document.querySelector('tr[data-worker-id=\"sim-2\"]').dataset.state") == "draining",
                10, 0.1, "sim-2 to show as draining")
            assert fleet.worker("sim-2")["state"] == "draining"

            browser.pump()
            assert browser.console_errors == []
        finally:
            browser.close()
    finally:
        fleet.close()


class DashboardOnly:
    """Just the dashboard's routes over a registry of `count` workers, served from a thread: the page at scale
    without 1000 worker processes (nor the health probes a real proxy would send to 1000 silent workers)."""

    def __init__(self, count: int) -> None:
        self.port = free_port()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(count),), daemon=True)
        self.stop: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def _serve(self, count: int) -> None:
        registry = Registry()
        for i in range(count):
            registry.register(WorkerRegistration(worker_id=f"w-{i:04d}", url=f"http://10.1.{i // 250}.{i % 250}:8000",
                                                 models=[f"model-{i % 4}"], engine="vllm"))
        app = web.Application()
        dashboard.add_routes(app, registry, ProxyMetrics(registry), dict)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        await self.stop.wait()
        await runner.cleanup()

    def __enter__(self) -> str:
        self.thread.start()
        assert self.ready.wait(30)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


def test_dashboard_stays_usable_at_a_thousand_workers(procs, tmp_path):
    with DashboardOnly(1000) as url:
        browser = Browser(procs, tmp_path / "chromium-profile")
        try:
            browser.open(url + "/dashboard")
            rows = "document.querySelectorAll('tr[data-worker-id]').length"
            wait_until(lambda: browser.evaluate(rows) == 200, 30, 0.2, "four groups of 50 rows")
            assert browser.evaluate("document.querySelectorAll('details.group').length") == 4
            assert "(1000 shown of 1000)" in browser.evaluate("document.getElementById('worker-count').textContent")
            assert "page 1 of 5" in browser.evaluate("document.querySelector('details.group .pager').textContent")
            browser.evaluate("document.querySelector('details.group button[data-step=\"1\"]').click()")
            first = "document.querySelector('details.group tr[data-worker-id]').dataset.workerId"
            wait_until(lambda: browser.evaluate(first) == "w-0200", 10, 0.1, "the second page")  # 50 x model-0 later
            browser.evaluate("(e => { e.value = 'w-0999'; e.dispatchEvent(new Event('input')); })"
                             "(document.getElementById('filter'))")
            assert browser.evaluate(rows) == 1
            browser.pump()
            assert browser.console_errors == []
        finally:
            browser.close()


def test_dashboard_scales_a_model_of_kvroute_up_with_the_admin_token(procs, tmp_path):
    config = tmp_path / "fleet.yaml"
    config.write_text("proxy:\n  host: 127.0.0.1\nmodels:\n  - name: tiny\n    engine: sim\n    preset: cpu-tiny\n"
                      "    device: cpu\n    replicas: 1\n    engine_args: {time-scale: 10}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.kvroute("up", str(config), "--port", str(port), "--run-dir", str(tmp_path / "logs"), name="up")
    wait_until(lambda: httpx.get(url + "/ready", timeout=2).status_code == 200, 90, 0.2, "kvroute up to be ready")
    browser = Browser(procs, tmp_path / "chromium-profile")
    try:
        browser.open(url + "/dashboard")
        ready = "document.querySelectorAll('tr[data-worker-id][data-state=\"ready\"]').length"
        wait_until(lambda: browser.evaluate(ready) == 1, 20, 0.2, "one ready worker on the page")
        token = admin_headers(url)["Authorization"].removeprefix("Bearer ")  # the one `kvroute up` made
        browser.evaluate(f"useToken('{token}')")
        wait_until(lambda: browser.evaluate("document.body.classList.contains('admin')"), 10, 0.1, "admin mode")
        browser.evaluate("""(i => { i.value = '2'; i.dispatchEvent(new Event('input', {bubbles: true})); })(
            document.querySelector('input[data-scale-input="tiny"]'));
            document.querySelector('button[data-scale="tiny"]').click()""")
        wait_until(lambda: browser.evaluate(ready) == 2, 60, 0.2, "the second replica, started from the page")
        assert browser.evaluate("document.querySelector('tr[data-model=\"tiny\"] td:nth-child(2)').textContent") == "2/2"
        browser.pump()
        assert browser.console_errors == []
    finally:
        browser.close()
