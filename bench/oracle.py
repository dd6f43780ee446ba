"""The oracle route (bench only): a tiny router that sees each sim worker's TRUE engine state with zero delay.

Owns the oracle's TTFT prediction and its forwarding; it is meant as a bound for the quality
benchmark (below: where it is not one), never a policy.
It tokenizes each request once with the sim's own rules (backends/sim/tokens.py), asks every sim worker
serving the body's model `POST /sim/probe` with the hashes of the prompt's full blocks (hashed once
here), which answers with the request's cached prefix there, the waiting and running queues and the free
KV blocks (read from the engine itself, no report interval), predicts the request's TTFT on each with
the sim's own step-time model (backends/sim/cost.py), and forwards the request to the minimum of
predicted TTFT + EVICT_WEIGHT x the prefill time of the cached blocks it would evict there.

Prediction on worker w (simulated seconds), with R running sequences and a token budget B per step:
- this request's uncached tokens = prompt - the longest prefix that is cached there, or that a request queued
  or running there (or sent there by the oracle and not yet visible) is computing: it will be cached first;
- prefill work ahead = uncached prompt tokens of the waiting queue + unfinished prefill of running ones
  + requests this oracle sent to w whose probe may not show them yet (in transit);
- steps = ceil((work ahead + this request's uncached tokens) / max(1, B - R)), each costing one step of
  step_time_s(B - R prefill tokens alongside R decodes) -> queue+prefill time; plus the vision encoder for
  the request's uncached image tokens (8 x ViT params FLOPs each);
- KV wait: if the blocks needed (work ahead and this request) exceed the free blocks, the time until enough
  running sequences finish to free them (their remaining decode tokens x one decode step).
Eviction: blocks allocated beyond the free blocks that hold nothing evict cached prefixes (LRU first);
pricing them at half their prefill time keeps hot prefixes on their owners. Without that term (pure
greedy TTFT) a smoke run in a closed loop on kv_pressure copied every prefix everywhere: engines' hit
rate 51% against 88-90% for kvroute and sglang cache_aware, p50 TTFT 9 s. The oracle is a strong,
fully informed reference, not a proof of optimality. Run: python -m bench.oracle --port P URL...

`--policy kv_aware` (route `oracle:kv_aware`) scores instead with kvroute's default cost function
(proxy/routing/kv_aware.py, its weights imported) fed the true state: the prefix each worker really holds
(or is computing) in place of the proxy's prefix index, true KV usage, waiting queue, requests on the
engine and prefill backlog (waiting requests' uncached tokens and running ones' unfinished prefill) in
place of reports up to one interval old and the proxy's own estimates.

`--policy kv_aware_owner` (route `oracle:kv_aware_owner`) also credits a prompt's blocks to every worker
they were sent to, as kvroute's prefix index does, or as far as the true state shows, whichever is longer.

None of them is a bound on this 2-core box (bench/results/2026-12-02-quality-oracles.md, 95% load, 3
repeats; one run at 50% outside the results folder):
- `ttft` copies long prefixes: in kv_pressure the engines' prefix hit rate was 58-59% at 95% load and 63%
  at 50% (decision p50 16 ms there), against kvroute's default's 95-96%.
- `kv_aware` and `kv_aware_owner`: at 50% in kv_pressure kv_aware_owner kept a 95% hit rate (TTFT p99 474
  ms against kvroute's 317); at 95% both fell to 61-67% with TTFT p50 7.8-9.8 s. Their decisions then
  took 36-125 ms (p50, wall), and 171-349 ms in zipf_hot, where the oracles' TTFT p50 (399-858 ms) was
  mostly their own decision time (kvroute's TTFT p50: 34-74 ms).
Four HTTP probes per request cost more time than kvroute's whole TTFT p50 here. A bound needs decisions
that cost nothing: sims that push their cache and queue changes to the oracle at each step, or the sims
stepped inside the oracle's process.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backends.sim import tokens as sim_tokens
from backends.sim.cost import StepWork, step_time_s
from backends.sim.kvcache import block_hashes, leading_run
from backends.sim.presets import Preset, get_preset
from backends.sim.tokens import Prompt, chat_prompt, completion_prompt
from proxy.routing import kv_aware

WORKER_HEADER = "x-kvroute-worker"
IN_TRANSIT_KEEP_S = 2.0  # how long an acknowledged send still counts as possibly unseen by later probes
EVICT_WEIGHT = 0.5  # seconds of cost per second of prefill that the blocks a request evicts would take to redo


@dataclass
class Sent:
    uncached_tokens: int
    blocks: int
    hashes: list[int] = field(default_factory=list)  # its full-block hashes (this process's; for in-transit prefixes)
    acked_at_probe: int | None = None  # probe counter when the worker answered (then the engine has it)
    acked_wall: float = 0.0


@dataclass
class WorkerView:
    url: str
    model: str = ""
    block_size: int = 16
    in_transit: list[Sent] = field(default_factory=list)
    sent_blocks: set[int] = field(default_factory=set)  # hashes of every full block sent here (policy kv_aware_owner)


def owned_blocks(sent_blocks: set[int], hashes: list[int]) -> int:
    """Leading blocks of a prompt that were sent to this worker before, cached there now or not."""
    return leading_run(hashes, sent_blocks)


def effective_cached(probe: dict[str, Any], in_transit_match: int = 0) -> int:
    """Prefix tokens this request will not prefill there: cached now, or computed by a request queued or
    running there (or sent there by the oracle) before this one is scheduled."""
    return max(probe["cached_tokens"], probe.get("pending_prefix_tokens", 0), in_transit_match)


def predict_ttft_s(preset: Preset, probe: dict[str, Any], extra_ahead_tokens: int = 0,
                   extra_ahead_blocks: int = 0) -> float:
    """Predicted TTFT (simulated seconds) of the probed request on the probed worker (see module docstring)."""
    running, waiting = probe["running"], probe["waiting"]
    r = len(running)
    budget = max(1, probe["max_num_batched_tokens"] - r)
    mine = max(1, probe["prompt_tokens"] - effective_cached(probe))
    ahead = sum(w[0] for w in waiting) + sum(x[0] for x in running) + extra_ahead_tokens
    total = ahead + mine
    steps = math.ceil(total / budget)
    avg_ctx = (sum(x[3] for x in running) / r) if r else 0.0
    chunk = min(total, budget)
    step = step_time_s(preset, StepWork(prefill_tokens=chunk, decode_seqs=r, prefill_seqs=1,
                                        kv_tokens_read=int(r * avg_ctx + chunk), attention_pairs=chunk * chunk // 2))
    vit = 8.0 * preset.vit_params * probe["media_tokens_uncached"] / (preset.peak_flops * preset.mfu)
    t = steps * step + vit
    # eviction: what is allocated beyond the empty free blocks throws cached prefixes out (priced, not waited)
    per_token = step_time_s(preset, StepWork(prefill_tokens=budget, prefill_seqs=1)) / budget
    evict_blocks = max(0, -(-mine // probe["block_size"]) + extra_ahead_blocks
                       + sum(-(-w[0] // probe["block_size"]) for w in waiting)
                       - probe.get("free_empty_blocks", probe["free_blocks"]))
    t += EVICT_WEIGHT * min(evict_blocks, probe["free_blocks"]) * probe["block_size"] * per_token
    # KV: blocks the queue ahead and this request need beyond what is free now
    bs = probe["block_size"]
    need = (-(-mine // bs) + sum(-(-w[0] // bs) for w in waiting) + extra_ahead_blocks
            + sum(-(-x[0] // bs) for x in running))
    deficit = need - probe["free_blocks"]
    if deficit > 0 and running:
        decode_step = step_time_s(preset, StepWork(decode_seqs=r, kv_tokens_read=int(r * avg_ctx)))
        freed = 0
        for _prefill, rest_decode, held, _ in sorted(running, key=lambda x: x[1]):
            freed += held
            if freed >= deficit:
                t += rest_decode * decode_step
                break
        else:
            t += max(x[1] for x in running) * decode_step * math.ceil(deficit / max(1, freed))
    if r + len(waiting) >= probe["max_num_seqs"] and running:
        t += min(x[1] for x in running) * step_time_s(preset, StepWork(decode_seqs=r))
    return t


class _Prompt:
    """What kv_aware.prefix_bonus reads of a request."""

    __slots__ = ("prompt_tokens",)

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens


def kv_aware_cost(probe: dict[str, Any], cached: int, unseen: list[Sent]) -> float:
    """kvroute's kv_aware cost(w) (proxy/routing/kv_aware.py) on the probed worker's true state; `unseen`:
    what the oracle sent there that the probe may not show yet (counted as waiting, uncached)."""
    bs = probe["block_size"]
    capacity = probe["num_blocks"] * bs
    usage = (probe["num_blocks"] - probe["free_blocks"] + sum(s.blocks for s in unseen)) / probe["num_blocks"]
    queue = len(probe["waiting"]) + len(unseen)
    in_flight = queue + len(probe["running"])
    backlog = (sum(w[0] for w in probe["waiting"]) + sum(r[0] for r in probe["running"])
               + sum(s.uncached_tokens for s in unseen))
    return (usage + kv_aware.QUEUE_WEIGHT * queue + kv_aware.INFLIGHT_WEIGHT * in_flight
            + kv_aware.BACKLOG_WEIGHT * backlog / capacity
            - kv_aware.prefix_bonus(_Prompt(probe["prompt_tokens"]), cached, capacity, usage))  # type: ignore[arg-type]


def _memoize_tokenizer() -> None:
    """In this process only: remember the sim tokenizer's answers for texts and images seen before (the shared
    system prompts and images come back all the time), so the oracle's own CPU does not queue requests."""
    text, image = sim_tokens.text_token_ids, sim_tokens.image_placeholder
    text_cached = functools.lru_cache(maxsize=8192)(lambda t: tuple(text(t)))
    sim_tokens.text_token_ids = lambda t: text_cached(t) if len(t) > 64 else text(t)  # type: ignore[assignment]
    sim_tokens.image_placeholder = functools.lru_cache(maxsize=1024)(image)  # type: ignore[assignment]


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common leading run of two hash chains."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


POLICIES = ("ttft", "kv_aware", "kv_aware_owner")


class Oracle:
    def __init__(self, urls: list[str], policy: str = "ttft") -> None:
        if policy not in POLICIES:
            raise ValueError(f"oracle policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.workers = [WorkerView(u) for u in urls]
        self.presets: dict[str, Preset] = {}
        self._probes = itertools.count()
        self.rng = random.Random(0)
        self.session: aiohttp.ClientSession | None = None
        self.decision_s: list[float] = []  # arrival to forwarding, per request

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600))
        for w in self.workers:
            async with self.session.get(w.url + "/v1/models") as resp:
                w.model = (await resp.json())["data"][0]["id"]
            async with self.session.get(w.url + "/sim/state") as resp:
                w.block_size = int((await resp.json())["block_size"])

    async def stop(self, _app: web.Application) -> None:
        if self.session:
            await self.session.close()

    @staticmethod
    def prompt_of(body: dict[str, Any]) -> Prompt:
        """The prompt by the sim's own rules (token ids and image spans): sent to each probe, nobody re-tokenizes."""
        return chat_prompt(body["messages"]) if "messages" in body else completion_prompt(body.get("prompt", ""))

    async def _probe(self, w: WorkerView, raw: bytes) -> dict[str, Any] | None:
        assert self.session is not None
        try:
            async with self.session.post(w.url + "/sim/probe", data=raw,
                                         headers={"Content-Type": "application/json"}) as resp:
                return await resp.json() if resp.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def models(self, _request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "oracle"} for m in sorted({w.model for w in self.workers})]
        return web.json_response({"object": "list", "data": data})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        raw = await request.read()
        try:
            body = orjson.loads(raw)
            model = body.get("model")
            prompt = self.prompt_of(body)
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError, KeyError) as exc:
            return web.json_response({"error": {"message": f"invalid request: {exc}", "type": "BadRequestError"}},
                                     status=400)
        candidates = [w for w in self.workers if w.model == model]
        if not candidates:
            return web.json_response({"error": {"message": f"model {model!r} not served", "type": "NotFoundError",
                                                "code": 404}}, status=404)
        # the prompt's reusable full blocks, hashed once here (per block size) instead of in every sim it probes
        by_size: dict[int, tuple[list[int], bytes]] = {}
        for w in candidates:
            if w.block_size not in by_size:
                bs, n = w.block_size, len(prompt.token_ids)
                chain = block_hashes(prompt.token_ids, bs, max(0, n - 1) // bs)
                by_size[bs] = (chain, orjson.dumps({"block_hashes": chain, "prompt_tokens": n,
                                                    "media_spans": prompt.media_spans}))
        seq = next(self._probes)
        probes = await asyncio.gather(*(self._probe(w, by_size[w.block_size][1]) for w in candidates))
        now = time.monotonic()
        best: tuple[float, int, WorkerView, dict[str, Any]] | None = None
        ties = 0
        hashes: list[int] = []
        for w, p in zip(candidates, probes, strict=True):
            if p is None or p.get("draining"):
                continue
            bs = p["block_size"]
            hashes = by_size[w.block_size][0]
            w.in_transit = [s for s in w.in_transit if s.acked_at_probe is None or now - s.acked_wall < IN_TRANSIT_KEEP_S]
            unseen = [s for s in w.in_transit if s.acked_at_probe is None or s.acked_at_probe > seq]
            match = max((_common(hashes, s.hashes) for s in unseen), default=0) * bs
            eff = effective_cached(p, match)
            p["pending_prefix_tokens"] = eff
            p["media_tokens_uncached"] = sum(max(0, a + n - max(a, eff)) for a, n in prompt.media_spans)
            if self.policy == "kv_aware_owner":
                t = kv_aware_cost(p, max(eff, owned_blocks(w.sent_blocks, hashes) * bs), unseen)
            elif self.policy == "kv_aware":
                t = kv_aware_cost(p, eff, unseen)
            else:
                preset = self.presets.get(p["preset"]) or self.presets.setdefault(p["preset"], get_preset(p["preset"]))
                t = predict_ttft_s(preset, p, sum(s.uncached_tokens for s in unseen), sum(s.blocks for s in unseen))
            key = (t, len(p["running"]) + len(p["waiting"]) + len(unseen))
            if best is None or key < best[:2]:
                best, ties = (*key, w, p), 1
            elif key == best[:2]:  # ties at random (reservoir sampling), not to the first worker listed
                ties += 1
                if self.rng.random() * ties < 1.0:
                    best = (*key, w, p)
        if best is None:
            return web.json_response({"error": {"message": "no worker answered the probe",
                                                "type": "ServiceUnavailableError", "code": 503}}, status=503)
        _, _, w, p = best
        uncached = max(1, p["prompt_tokens"] - effective_cached(p))
        sent = Sent(uncached, -(-uncached // p["block_size"]), by_size[w.block_size][0])
        w.in_transit.append(sent)
        if self.policy == "kv_aware_owner":
            w.sent_blocks.update(sent.hashes)
        self.decision_s.append(time.perf_counter() - t0)
        return await self._relay(request, w, raw, sent)

    async def stats(self, _request: web.Request) -> web.Response:
        """How long the oracle's decisions took (wall seconds): its own overhead, apart from its routing."""
        xs = sorted(self.decision_s)
        p50, p99 = (xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None for q in (0.5, 0.99))
        return web.json_response({"decisions": len(xs), "p50_s": p50, "p99_s": p99})

    async def _relay(self, request: web.Request, w: WorkerView, raw: bytes, sent: Sent) -> web.StreamResponse:
        assert self.session is not None
        try:
            async with self.session.post(w.url + request.path, data=raw,
                                         headers={"Content-Type": "application/json"}) as up:
                sent.acked_at_probe, sent.acked_wall = next(self._probes), time.monotonic()
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json"), WORKER_HEADER: w.url})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except aiohttp.ClientError as exc:
            return web.json_response({"error": {"message": f"upstream: {exc}", "type": "BadGatewayError",
                                                "code": 502}}, status=502)
        finally:
            if sent.acked_at_probe is None:
                sent.acked_at_probe, sent.acked_wall = -1, time.monotonic()


def build_app(urls: list[str], policy: str = "ttft") -> web.Application:
    oracle = Oracle(urls, policy)
    app = web.Application(client_max_size=64 * 1024**2)
    app.router.add_post("/v1/chat/completions", oracle.forward)
    app.router.add_post("/v1/completions", oracle.forward)
    app.router.add_get("/v1/models", oracle.models)
    app.router.add_get("/health", oracle.health)
    app.router.add_get("/oracle/stats", oracle.stats)
    app.on_startup.append(oracle.start)
    app.on_cleanup.append(oracle.stop)
    return app


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--policy", choices=POLICIES, default="ttft",
                   help="ttft: predicted TTFT + eviction price (the default); kv_aware: kvroute's default cost "
                        "on the true state; kv_aware_owner: the same, a prefix credited to every worker it was sent to")
    p.add_argument("urls", nargs="+", help="sim worker base URLs")
    args = p.parse_args()
    import uvloop

    uvloop.install()
    _memoize_tokenizer()
    web.run_app(build_app(args.urls, args.policy), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
