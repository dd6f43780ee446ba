"""Chaos benchmark (issue 12): a kvroute proxy and N sim workers under steady load while workers are
SIGKILLed and restarted, frozen with SIGSTOP, one fails a share of requests with 5xx, and Redis restarts.

Owns the fault schedule, the chaos client (it classifies every request's fate) and the per-round
figures (failures by kind, retries and migrations from /metrics, in-flight, proxy fds and RSS); the
processes and their faults are chaos_fleet.py's, the result files are written with report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.chaos_fleet import FULL_REQUESTS, FULL_ROUNDS, MODEL, ChaosFleet, ChaosSettings, Slot
from bench.loadgen import percentile
from bench.report import environment_note, fmt, md_table, results_path, write_json
from proxy import promtext

QUICK_DIR = Path(__file__).resolve().parent / ".runs" / "quick-results"
FAILURE_KINDS = ("http", "error_event", "truncated", "timeout", "connection")


@dataclass
class Outcome:
    kind: str            # "ok" or one of FAILURE_KINDS
    latency_s: float
    stream: bool
    detail: str = ""


# --- load ------------------------------------------------------------------------------------------------

def make_bodies(n: int, rng: random.Random, max_tokens: tuple[int, int]) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) pairs: chat and completions, streaming and not, each asking for exactly max_tokens."""
    words = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")
    out = []
    for i in range(n):
        text = f"request {i}: " + " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(24))
        stream = rng.random() < 0.6
        body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(*max_tokens), "stream": stream,
                                "ignore_eos": True, "temperature": 0.0}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.75:
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}))
        else:
            out.append(("/v1/completions", {**body, "prompt": text}))
    return out


def _check_stream(raw: bytes, want_tokens: int) -> tuple[str, str]:
    """(kind, detail) of a finished 200 stream: an error event, no [DONE], or a wrong token count."""
    done, usage = False, None
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "truncated", "malformed event"
        if "error" in obj:
            return "error_event", str(obj["error"])[:160]
        if obj.get("usage"):
            usage = obj["usage"]
    if not done:
        return "truncated", "no [DONE]"
    got = (usage or {}).get("completion_tokens")
    if got != want_tokens:
        return "truncated", f"completion_tokens {got} != {want_tokens}"
    return "ok", ""


async def _one(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
               deadline_s: float) -> Outcome:
    t0 = time.perf_counter()
    stream = bool(body.get("stream"))
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(url + path, data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"}) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    return Outcome("http", time.perf_counter() - t0, stream, f"{resp.status} {raw[:160]!r}")
                if stream:
                    kind, detail = _check_stream(raw, body["max_tokens"])
                    return Outcome(kind, time.perf_counter() - t0, stream, detail)
                obj = orjson.loads(raw)
                got = (obj.get("usage") or {}).get("completion_tokens")
                if got != body["max_tokens"]:
                    return Outcome("truncated", time.perf_counter() - t0, stream,
                                   f"completion_tokens {got} != {body['max_tokens']}")
                return Outcome("ok", time.perf_counter() - t0, stream)
    except TimeoutError:
        return Outcome("timeout", time.perf_counter() - t0, stream, f"open after {deadline_s}s")
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        return Outcome("connection", time.perf_counter() - t0, stream, f"{type(exc).__name__}: {exc}"[:160])


class Load:
    """A closed loop of `concurrency` clients over `bodies`; `done` counts finished requests."""

    def __init__(self, url: str, bodies: list[tuple[str, dict[str, Any]]], concurrency: int, deadline_s: float):
        self.url, self.bodies, self.concurrency, self.deadline_s = url, bodies, concurrency, deadline_s
        self.outcomes: list[Outcome] = []
        self._next = 0
        self._progress = asyncio.Condition()

    @property
    def done(self) -> int:
        return len(self.outcomes)

    async def wait_done(self, count: int) -> None:
        async with self._progress:
            await self._progress.wait_for(lambda: self.done >= count)

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def client() -> None:
                while self._next < len(self.bodies):
                    path, body = self.bodies[self._next]
                    self._next += 1
                    self.outcomes.append(await _one(session, self.url, path, body, self.deadline_s))
                    async with self._progress:
                        self._progress.notify_all()

            await asyncio.gather(*(client() for _ in range(self.concurrency)))


# --- faults over one round -------------------------------------------------------------------------------

class Injector:
    """Applies the round's faults at fractions of the load's progress, always leaving one worker that is
    neither killed, frozen nor the 5xx one; restarts and thaws run as their own tasks."""

    def __init__(self, fleet: ChaosFleet, load: Load, rng: random.Random) -> None:
        self.fleet, self.load, self.rng = fleet, load, rng
        self.events: list[dict[str, Any]] = []
        self._pending: list[asyncio.Task] = []
        self._t0 = time.perf_counter()

    def _plan(self) -> list[tuple[float, str]]:
        s = self.fleet.settings
        kinds = ["kill"] * s.kills + ["stall"] * s.stalls + (["redis"] if s.state == "redis" else [])
        self.rng.shuffle(kinds)
        # spread evenly over the first 60% of the round (jittered), so that a fault waiting for a victim
        # (every other worker already down or restarting) still lands while the load runs
        step = 0.55 / max(1, len(kinds))
        return [(0.05 + step * (i + self.rng.random() * 0.5), k) for i, k in enumerate(kinds)]

    def _healthy(self) -> list[Slot]:
        return [sl for sl in self.fleet.slots if not sl.faulted and sl is not self.fleet.fail_slot]

    def _note(self, kind: str, target: str, **extra: Any) -> None:
        self.events.append({"t_s": round(time.perf_counter() - self._t0, 2), "done": self.load.done,
                            "fault": kind, "target": target, **extra})

    async def run(self) -> None:
        n = len(self.load.bodies)
        for fraction, kind in self._plan():
            await self.load.wait_done(int(fraction * n))
            if kind == "redis":
                await asyncio.to_thread(self.fleet.restart_redis)
                self._note("redis_restart", "redis-server")
                continue
            while True:  # any worker not already faulted, but never the last healthy one
                healthy = self._healthy()
                allowed = [sl for sl in self.fleet.slots if not sl.faulted and (sl not in healthy or len(healthy) > 1)]
                if allowed:
                    victim = self.rng.choice(allowed)
                    break
                if self.load.done >= n:
                    self._note("skipped", kind)
                    return
                await asyncio.sleep(0.05)
            if kind == "kill":
                in_flight = await _in_flight(self.fleet.url, victim.worker_id)  # just before: the proxy ends them fast
                await asyncio.to_thread(self.fleet.kill, victim)
                self.fleet.kills_done += 1
                slow = self.fleet.settings.slow_start_s if self.fleet.kills_done % 2 == 0 else 0.0
                self._note("sigkill", victim.worker_id, in_flight=in_flight)
                self._pending.append(asyncio.create_task(self._restart_later(victim, self.rng.uniform(0.3, 1.5),
                                                                             slow)))
            else:
                seconds = self.rng.uniform(*self.fleet.settings.stall_s)
                self.fleet.freeze(victim)
                self._note("sigstop", victim.worker_id, seconds=round(seconds, 1))
                self._pending.append(asyncio.create_task(self._thaw_later(victim, seconds)))

    async def _restart_later(self, slot: Slot, delay: float, slow_start_s: float) -> None:
        await asyncio.sleep(delay)
        self.fleet.restart(slot, slow_start_s)
        self._note("restart", slot.worker_id, slow_start_s=slow_start_s)
        # faulted until the proxy routes to it again: freezing a worker nobody sends to tests nothing
        await _all_ready(self.fleet, [slot.worker_id])
        slot.faulted = ""
        self._note("ready", slot.worker_id)

    async def _thaw_later(self, slot: Slot, delay: float) -> None:
        await asyncio.sleep(delay)
        self.fleet.thaw(slot)
        self._note("sigcont", slot.worker_id)

    async def settle(self) -> None:
        await asyncio.gather(*self._pending)


async def _get_text(url: str, limit_s: float = 5.0) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit_s)) as resp:
            return await resp.text()


async def _metrics(url: str) -> promtext.Metrics:
    return promtext.parse(await _get_text(url + "/metrics"))


async def _in_flight(url: str, worker_id: str | None = None) -> float:
    m = await _metrics(url)
    return m.total("kvroute:worker_in_flight", {"worker": worker_id} if worker_id else None) or 0.0


def _counters(m: promtext.Metrics) -> dict[str, float]:
    totals = m.totals()
    out = {"retries": totals.get("kvroute:retries_total", 0.0),
           "stream_failures": totals.get("kvroute:stream_failures_total", 0.0),
           "rejections": totals.get("kvroute:rejections_total", 0.0)}
    # kvroute:migrations by outcome: streams continued elsewhere, non-streamed requests restarted elsewhere,
    # and streams that could not move (ended with the error event)
    for outcome in ("continued", "restarted", "failed"):
        out[f"migrations_{outcome}"] = m.total("kvroute:migrations_total", {"outcome": outcome}) or 0.0
    out["migrations"] = out["migrations_continued"] + out["migrations_restarted"]
    return out


async def _all_ready(fleet: ChaosFleet, ids: list[str] | None = None, limit_s: float = 60.0) -> float:
    """Seconds until every worker (or those of `ids`) is ready at the proxy again."""
    t0 = time.perf_counter()
    want = set(ids) if ids else {sl.worker_id for sl in fleet.slots}
    while time.perf_counter() - t0 < limit_s:
        try:
            data = orjson.loads(await _get_text(fleet.url + "/workers"))
            if want <= {w["worker_id"] for w in data["workers"] if w["state"] == "ready"}:
                return time.perf_counter() - t0
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError):
            pass
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{sorted(want)} not all ready again after {limit_s}s")


async def run_round(fleet: ChaosFleet, index: int, rng: random.Random) -> dict[str, Any]:
    s = fleet.settings
    before = _counters(await _metrics(fleet.url))
    load = Load(fleet.url, make_bodies(s.requests, rng, s.max_tokens), s.concurrency, s.deadline_s)
    injector = Injector(fleet, load, rng)
    t0 = time.perf_counter()
    inject = asyncio.create_task(injector.run())
    await load.run()
    wall = time.perf_counter() - t0
    await inject
    await injector.settle()
    # in flight once the load is over: every accounting path must have run (nothing waits on the fleet)
    settle_t0 = time.perf_counter()
    in_flight = await _in_flight(fleet.url)
    while in_flight and time.perf_counter() - settle_t0 < 15.0:
        await asyncio.sleep(0.1)
        in_flight = await _in_flight(fleet.url)
    ready_s = await _all_ready(fleet)
    after = _counters(await _metrics(fleet.url))
    outcomes = load.outcomes
    failures = {k: sum(o.kind == k for o in outcomes) for k in FAILURE_KINDS}
    latencies = [o.latency_s for o in outcomes]
    return {
        "round": index, "requests": len(outcomes), "succeeded": sum(o.kind == "ok" for o in outcomes),
        "streaming": sum(o.stream for o in outcomes), "failures": failures,
        "failure_examples": sorted({f"{o.kind}: {o.detail}" for o in outcomes if o.kind != "ok"})[:8],
        "retries": after["retries"] - before["retries"], "migrations": after["migrations"] - before["migrations"],
        **{k: after[k] - before[k] for k in ("migrations_continued", "migrations_restarted", "migrations_failed")},
        "stream_failures": after["stream_failures"] - before["stream_failures"],
        "rejections": after["rejections"] - before["rejections"],
        "in_flight_after": in_flight, "in_flight_settle_s": round(time.perf_counter() - settle_t0, 2),
        "all_ready_again_s": round(ready_s, 2), "wall_s": round(wall, 1),
        "lat_p50_s": percentile(latencies, 50), "lat_p99_s": percentile(latencies, 99),
        "lat_max_s": max(latencies, default=None),
        "faults": {k: sum(e["fault"] == k for e in injector.events) for k in
                   ("sigkill", "sigstop", "redis_restart")},
        "events": injector.events,
        "proxy_fds": fleet.proxy_fds(), "proxy_rss_mb": round(fleet.proxy_rss_mb(), 1),
    }


async def run_chaos(settings: ChaosSettings, log_dir: Path, progress=print) -> dict[str, Any]:
    """Start the fleet, run the rounds, stop every process; the data of the run as a dict."""
    fleet = ChaosFleet(settings, log_dir)
    rng = random.Random(settings.seed)
    rounds: list[dict[str, Any]] = []
    try:
        await asyncio.to_thread(fleet.start)
        await _all_ready(fleet)
        baseline = {"proxy_fds": fleet.proxy_fds(), "proxy_rss_mb": round(fleet.proxy_rss_mb(), 1)}
        for i in range(1, settings.rounds + 1):
            row = await run_round(fleet, i, rng)
            rounds.append(row)
            progress(f"[chaos] round {i}: {row['succeeded']}/{row['requests']} ok, failures {row['failures']}, "
                     f"retries {row['retries']:.0f}, migrations {row['migrations']:.0f}, in flight after "
                     f"{row['in_flight_after']:.0f}, fds {row['proxy_fds']}, RSS {row['proxy_rss_mb']} MB, "
                     f"{row['wall_s']} s")
    finally:
        fleet.stop()  # blocking on purpose: it must run even while the run is being cancelled
    return {"settings": asdict(settings), "environment": environment_note(), "baseline": baseline,
            "rounds": rounds, "log_dir": str(log_dir)}


# --- report ----------------------------------------------------------------------------------------------

def render(data: dict[str, Any], quick: bool) -> str:
    s = data["settings"]
    rows = [[r["round"], r["requests"], r["streaming"], r["succeeded"], *(r["failures"][k] for k in FAILURE_KINDS),
             f"{r['faults']['sigkill']}/{r['faults']['sigstop']}/{r['faults']['redis_restart']}",
             fmt(r["retries"], digits=0), fmt(r.get("migrations_continued"), digits=0),
             fmt(r.get("migrations_restarted"), digits=0), fmt(r.get("migrations_failed"), digits=0),
             fmt(r["stream_failures"], digits=0),
             fmt(r["in_flight_after"], digits=0), r["proxy_fds"], r["proxy_rss_mb"], fmt(r["lat_max_s"], digits=1),
             r["wall_s"]] for r in data["rounds"]]
    head = "# Chaos run" + (" (QUICK RUN: NOT THE FULL SIZE)" if quick else "")
    text = [head, "", data["environment"], "",
            f"`{data.get('command', 'kvroute bench chaos')}`", "",
            f"Fleet: a kvroute proxy (state {s['state']}) and {s['workers']} sim workers at time scale "
            f"{s['time_scale']}; {s['concurrency']} closed-loop clients, {s['requests']} requests per round "
            f"(60% streaming, chat and completions, {s['max_tokens'][0]}-{s['max_tokens'][1]} tokens with "
            f"ignore_eos), a request open after {s['deadline_s']} s counts as a hang. Faults per round: "
            f"{s['kills']} SIGKILLs (restart with the same id after 0.3-1.5 s, every other one with a "
            f"{s['slow_start_s']} s slow start), {s['stalls']} SIGSTOP/SIGCONT stalls of {s['stall_s'][0]}-"
            f"{s['stall_s'][1]} s, the last worker fails {s['fail_rate']:.0%} of requests with HTTP 500"
            + (", a redis-server restart" if s["state"] == "redis" else "")
            + "; one worker that is neither killed, frozen nor failing is always left.", "",
            "Failures are what the client saw: `http` a non-200 answer, `error_event` an error event inside a "
            "200 stream, `truncated` a stream without [DONE] or an answer whose completion_tokens is not "
            "max_tokens, `timeout` still open at the deadline, `connection` the connection to the proxy "
            "failed. Retries (before the first byte), migrations (kvroute:migrations by outcome: a stream continued "
            "on another worker, a non-streamed request restarted on another, a stream that could not move) and "
            "stream failures are the proxy's /metrics deltas over the round; "
            "in flight is the sum of kvroute:worker_in_flight after the load ended; fds (/proc/PID/fd) and "
            "RSS of the proxy process after the round, with every worker ready again.", "",
            f"Before round 1: {data['baseline']['proxy_fds']} fds, {data['baseline']['proxy_rss_mb']} MB.", "",
            md_table(["round", "requests", "streaming", "succeeded", *FAILURE_KINDS, "kills/stalls/redis",
                      "retries", "streams migrated", "whole restarted", "migrations failed", "stream failures", "in flight after", "proxy fds", "proxy RSS MB",
                      "max latency s", "wall s"], rows), ""]
    for r in data["rounds"]:
        if r["failure_examples"]:
            text.append(f"Round {r['round']} failures, examples: " + "; ".join(r["failure_examples"]))
    text.append(f"\nLogs: {data['log_dir']}")
    return "\n".join(text) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ChaosSettings()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--requests", type=int, default=d.requests, help="requests per round")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--kills", type=int, default=d.kills, help="SIGKILLs (with restart) per round")
    p.add_argument("--stalls", type=int, default=d.stalls, help="SIGSTOP/SIGCONT stalls per round")
    p.add_argument("--stall-s", default=f"{d.stall_s[0]:g}:{d.stall_s[1]:g}", help="MIN:MAX seconds of a stall")
    p.add_argument("--slow-start-s", type=float, default=d.slow_start_s,
                   help="every other restart waits this long before listening")
    p.add_argument("--fail-rate", type=float, default=d.fail_rate, help="share of 5xx of the last worker; 0: none")
    p.add_argument("--state", choices=("memory", "redis"), default=d.state,
                   help="redis: the proxy keeps its state in a redis-server of the run's own, restarted each round")
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--deadline-s", type=float, default=d.deadline_s, help="a request open longer is a hang")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default bench/results/, or bench/.runs/quick-results/ for a run below full size")
    p.add_argument("--name", default="chaos")


def settings_from(args: argparse.Namespace) -> ChaosSettings:
    return ChaosSettings(workers=args.workers, requests=args.requests, rounds=args.rounds,
                         concurrency=args.concurrency, kills=args.kills, stalls=args.stalls, fail_rate=args.fail_rate,
                         stall_s=tuple(float(x) for x in args.stall_s.split(":")), slow_start_s=args.slow_start_s,
                         state=args.state, time_scale=args.time_scale, deadline_s=args.deadline_s, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if settings.workers < 2:
        raise SystemExit("--workers must be at least 2 (one always stays healthy)")
    quick = settings.requests < FULL_REQUESTS or settings.rounds < FULL_ROUNDS
    out_dir = args.out_dir or (QUICK_DIR if quick else None)
    log_dir = Path(__file__).resolve().parent / ".runs" / f"chaos-{int(time.time())}"
    data = asyncio.run(run_chaos(settings, log_dir))
    data["command"] = "kvroute bench chaos " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "chaos"] \
        else "kvroute bench chaos"
    data["quick"] = quick
    text = render(data, quick)
    md_path = results_path(args.name, ".md", out_dir)
    md_path.write_text(text)
    write_json(results_path(args.name, ".json", out_dir), data)
    print(text)
    print(f"[chaos] wrote {md_path}")
    failed = sum(sum(r["failures"].values()) for r in data["rounds"])
    return 0 if failed == 0 and all(r["in_flight_after"] == 0 for r in data["rounds"]) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
