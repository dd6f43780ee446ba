"""The load generator: send OpenAI requests closed-loop or open-loop and record each one's fate.

Owns request timing (TTFT, end-to-end latency), outcome classes (ok / rejected / failed) and
arrival schedules; it knows nothing about which router or worker sits behind the URL.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

WORKER_HEADER = "x-kvroute-worker"
REJECTED_STATUSES = (429, 503)


@dataclass
class RequestSpec:
    """One request to send: OpenAI path + JSON body, and when to send it (open loop)."""

    body: dict[str, Any]
    path: str = "/v1/chat/completions"
    arrival_s: float = 0.0  # offset from the run's start; ignored by the closed loop
    tag: str = ""  # free label (workload part, session id) carried into the result
    after: int | None = None  # index of a request that must finish first (the previous turn of a session)
    gap_s: float = 0.0  # and then this long (think time) before this one is sent

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Result:
    """What happened to one request, from the client's side."""

    index: int
    tag: str
    status: int  # HTTP status; 0 when no response came (connect error, timeout)
    sent_at: float  # seconds since the run's start
    latency_s: float  # until the last byte (or the failure)
    ttft_s: float | None = None  # until the chunk with the first generated token (streams only)
    worker: str | None = None  # x-kvroute-worker, or the direct target URL
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    itl_s: float | None = None  # mean time between two generated tokens after the first (streams of 2+ tokens)
    gaps: list[float] | None = None  # every such gap, when the generator records them (record_gaps)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def rejected(self) -> bool:
        return self.status in REJECTED_STATUSES

    @property
    def failed(self) -> bool:
        return not self.ok and not self.rejected


@dataclass
class RunResult:
    results: list[Result]
    wall_s: float
    started_at: float  # time.time() at the start, to line up with samplers
    extra: dict[str, Any] = field(default_factory=dict)


def poisson_arrivals(rate_per_s: float, count: int, seed: int) -> list[float]:
    """Arrival offsets of a Poisson process with the given mean rate."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def bursty_arrivals(rate_per_s: float, count: int, seed: int, burst_factor: float = 4.0,
                    period_s: float = 5.0, duty: float = 0.2) -> list[float]:
    """Poisson arrivals whose rate is burst_factor x higher during `duty` of every period.

    The quiet-phase rate is lowered so that the long-run mean stays `rate_per_s`.
    """
    rng = random.Random(seed)
    high = rate_per_s * burst_factor
    low = max(rate_per_s * (1 - duty * burst_factor) / (1 - duty), rate_per_s * 0.05)
    t, out = 0.0, []
    while len(out) < count:  # thinning: candidates at the peak rate, kept with prob rate(t)/peak
        t += rng.expovariate(high)
        if (t % period_s) < duty * period_s or rng.random() < low / high:
            out.append(t)
    return out


def _usage(obj: dict[str, Any], res: Result) -> None:
    usage = obj.get("usage") or {}
    res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)
    res.completion_tokens = int(usage.get("completion_tokens") or res.completion_tokens)


def carries_token(chunk: dict[str, Any]) -> bool:
    """Whether an SSE chunk carries a generated token: a completion's text (even empty: a token can decode to
    nothing), or a chat delta other than the role-only one vLLM opens its stream with (it sends that one with
    the first token, but a router or engine may send it earlier)."""
    choices = chunk.get("choices") or []
    if not choices:
        return False  # the usage chunk
    choice = choices[0]
    if "text" in choice:
        return True
    delta = choice.get("delta") or {}
    if "role" in delta and not delta.get("content"):
        return False
    return bool(delta) or choice.get("finish_reason") is not None


async def _consume_stream(resp: aiohttp.ClientResponse, res: Result, t0: float, record_gaps: bool = False) -> None:
    """Read SSE events; TTFT is the first event carrying a generated token, the inter-token latency the mean gap
    between the token-carrying events after it (and each gap with `record_gaps`)."""
    chunks = 0
    buf = b""
    first_at = last_at = 0.0
    gaps: list[float] | None = [] if record_gaps else None
    async for data in resp.content.iter_any():
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if "error" in obj:  # an error inside a 200 stream (LMDeploy does this) is a failure
                res.error = str(obj["error"])[:200]
            if obj.get("error_code"):
                res.error = f"error_code {obj['error_code']}"
            if carries_token(obj):
                chunks += 1
                now = time.perf_counter()
                if res.ttft_s is None:
                    res.ttft_s = now - t0
                    first_at = now
                elif gaps is not None:
                    gaps.append(now - last_at)
                last_at = now
            if obj.get("usage"):
                _usage(obj, res)
    if not res.completion_tokens:
        res.completion_tokens = chunks
    if chunks > 1:
        res.itl_s = (last_at - first_at) / (chunks - 1)
        res.gaps = gaps


class _Done:
    """Completion events by request index, for requests that wait on an earlier one."""

    def __init__(self, n: int) -> None:
        self._events: dict[int, asyncio.Event] = {}
        self.n = n

    def _event(self, i: int) -> asyncio.Event:
        return self._events.setdefault(i, asyncio.Event())

    def set(self, i: int) -> None:
        self._event(i).set()

    async def after(self, spec: RequestSpec, gap_scale: float) -> None:
        if spec.after is None or not 0 <= spec.after < self.n:
            return
        await self._event(spec.after).wait()
        if spec.gap_s > 0 and gap_scale > 0:
            await asyncio.sleep(spec.gap_s * gap_scale)


class LoadGenerator:
    """Sends RequestSpecs to one base URL, or round-robin over several (client-side "direct")."""

    def __init__(self, targets: str | Sequence[str] | dict[str, Sequence[str]], timeout_s: float = 300.0,
                 connections: int = 0, headers: dict[str, str] | None = None, record_gaps: bool = False) -> None:
        self.record_gaps = record_gaps  # keep every inter-token gap of each stream (Result.gaps)
        # a dict is model -> worker URLs: client-side round robin among the workers of the body's model
        self.by_model = {m: list(us) for m, us in targets.items()} if isinstance(targets, dict) else None
        self.targets = [targets] if isinstance(targets, str) else \
            [u for us in self.by_model.values() for u in us] if self.by_model else list(targets)
        self._turns: dict[str, int] = {}
        self.timeout_s = timeout_s
        self.connections = connections
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def _session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self.connections, limit_per_host=0, force_close=False,
                                         enable_cleanup_closed=True)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    def _target(self, index: int, spec: RequestSpec) -> str:
        if self.by_model is None:
            return self.targets[index % len(self.targets)]
        model = str(spec.body.get("model"))
        urls = self.by_model.get(model) or self.targets
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        return urls[turn % len(urls)]

    async def _send(self, session: aiohttp.ClientSession, index: int, spec: RequestSpec,
                    run_t0: float) -> Result:
        target = self._target(index, spec)
        t0 = time.perf_counter()
        res = Result(index=index, tag=spec.tag, status=0, sent_at=t0 - run_t0, latency_s=0.0)
        try:
            async with session.post(target + spec.path, data=orjson.dumps(spec.body), headers=self.headers) as resp:
                res.status = resp.status
                res.worker = resp.headers.get(WORKER_HEADER) or (target if len(self.targets) > 1 else None)
                if resp.status != 200:
                    res.error = (await resp.text())[:200]
                elif spec.stream:
                    await _consume_stream(resp, res, t0, self.record_gaps)
                else:
                    raw = await resp.read()  # no token is seen before the whole answer: no TTFT
                    obj = orjson.loads(raw)
                    if "error" in obj or obj.get("error_code"):
                        res.error = str(obj.get("error") or obj.get("error_code"))[:200]
                    _usage(obj, res)
        except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            res.error = f"{type(exc).__name__}: {exc}"[:200]
        res.latency_s = time.perf_counter() - t0
        return res

    async def closed_loop(self, specs: Sequence[RequestSpec], concurrency: int,
                          time_limit_s: float | None = None) -> RunResult:
        """`concurrency` clients, each sending its next request as soon as the last one ends
        (and no new one after `time_limit_s`)."""
        results: list[Result] = []
        next_index = 0
        started_at = time.time()
        run_t0 = time.perf_counter()
        stop_at = run_t0 + time_limit_s if time_limit_s else float("inf")
        done = _Done(len(specs))

        async def client(session: aiohttp.ClientSession) -> None:
            nonlocal next_index
            while next_index < len(specs) and time.perf_counter() < stop_at:
                i = next_index
                next_index += 1
                await done.after(specs[i], 0.0)  # closed loop: no think time
                results.append(await self._send(session, i, specs[i], run_t0))
                done.set(i)

        async with self._session() as session:
            await asyncio.gather(*(client(session) for _ in range(min(concurrency, len(specs)))))
        return RunResult(sorted(results, key=lambda r: r.index), time.perf_counter() - run_t0, started_at)

    async def open_loop(self, specs: Sequence[RequestSpec], max_outstanding: int = 4096,
                        gap_scale: float = 1.0) -> RunResult:
        """Send each request at its arrival_s, whether or not earlier ones have finished; a request with
        `after` also waits for that one to finish plus gap_s x gap_scale (a session's next turn)."""
        gate = asyncio.Semaphore(max_outstanding)  # a safety bound, far above any sane queue
        started_at = time.time()
        run_t0 = time.perf_counter()
        done = _Done(len(specs))

        async def one(session: aiohttp.ClientSession, i: int, spec: RequestSpec) -> Result:
            delay = spec.arrival_s - (time.perf_counter() - run_t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await done.after(spec, gap_scale)
            async with gate:
                res = await self._send(session, i, spec, run_t0)
            done.set(i)
            return res

        async with self._session() as session:
            results = await asyncio.gather(*(one(session, i, s) for i, s in enumerate(specs)))
        return RunResult(list(results), time.perf_counter() - run_t0, started_at)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run: RunResult, ttft_slo_s: float | None = None) -> dict[str, Any]:
    """Headline numbers of one run: counts, rates, latency percentiles (seconds), per-worker counts."""
    rs = run.results
    ok = [r for r in rs if r.ok]
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    per_worker: dict[str, int] = {}
    for r in ok:
        if r.worker:
            per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    out: dict[str, Any] = {
        "requests": len(rs), "ok": len(ok),
        "rejected": sum(r.rejected for r in rs), "failed": sum(r.failed for r in rs),
        "rejected_429": sum(r.status == 429 for r in rs), "rejected_503": sum(r.status == 503 for r in rs),
        "wall_s": run.wall_s, "req_per_s": len(ok) / run.wall_s if run.wall_s else 0.0,
        "output_tok_per_s": sum(r.completion_tokens for r in ok) / run.wall_s if run.wall_s else 0.0,
        "lat_p50": percentile(lat, 50), "lat_p99": percentile(lat, 99),
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
        "per_worker": per_worker,
        "errors": sorted({r.error for r in rs if r.error})[:5],
    }
    if ttft_slo_s is not None:
        good = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s)
        out["goodput_frac"] = good / len(rs) if rs else 0.0
        out["goodput_per_s"] = good / run.wall_s if run.wall_s else 0.0
    return out


def chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int, stream: bool) -> dict[str, Any]:
    """An OpenAI chat body that makes the worker produce exactly max_tokens tokens."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "stream": stream, "ignore_eos": True, "temperature": 0.0}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
