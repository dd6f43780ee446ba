"""The oracle route (bench only): a tiny router that sees each sim worker's TRUE engine state, one engine step old.

Owns the oracle's mirror of the fleet, its TTFT prediction and its forwarding; it is meant as a bound for the
quality benchmark, never a policy.
Each sim worker pushes its state at every engine step (`GET /sim/feed`, backends/sim/feed.py): the block
hashes entering and leaving its prefix cache, the waiting and running queues, the free KV blocks and how many
requests its scheduler has received. The oracle keeps a copy per worker and adds what only it knows: the
requests it sent there that the engine has not received yet (`unseen`), and the prefixes its unfinished
requests there are computing. Nothing in an engine changes between two steps but arrivals and aborts, so the
copy is exact up to the time a feed line takes to arrive; a decision reads only the copy (no round trip).
It tokenizes each request once with the sim's own rules (backends/sim/tokens.py), hashes the prompt's full
blocks as the sims do, predicts the request's TTFT on each worker serving the body's model with the sim's own
step-time model (backends/sim/cost.py), and forwards it to the minimum of predicted TTFT + EVICT_WEIGHT x the
prefill time of the cached blocks it would evict there.

Run: python -m bench.oracle --port P URL... (the mirror and the predictions: bench/oracle_view.py)

`--policy kv_aware` (route `oracle:kv_aware`) scores instead with kvroute's default cost function
(proxy/routing/kv_aware.py, its weights imported) fed the true state: the prefix each worker really holds
(or is computing) in place of the proxy's prefix index, true KV usage, waiting queue, requests on the
engine and prefill backlog (waiting requests' uncached tokens and running ones' unfinished prefill) in
place of reports up to one interval old and the proxy's own estimates.

`--policy kv_aware_owner` (route `oracle:kv_aware_owner`) also credits a prompt's blocks to every worker
they were sent to, as kvroute's prefix index does, or as far as the true state shows, whichever is longer.

Admission: like kvroute's (proxy/routing/admission.py) it binds late. While every engine serving the model
has requests waiting, or requests the oracle sent that its scheduler has not received, a request waits in a
per-model FIFO; each feed line and each finished request lets the head go once some engine has taken its
queue in, and the released request's own send lets the next one go (arrivals never jump the queue).
`--send-now` turns that off.

Measured, open loop at 95% load, 3 repeats (bench/results/2026-12-02-quality-oracles-feed.md):
- kv_pressure: every scoring keeps a 95-96% hit rate with no preemption; `kv_aware` has the lowest TTFT
  p99 (464 ms, against kvroute's default's 1081 ms); `kv_aware_owner` with `--send-now` falls behind the
  arrivals (33 of 88 req/s served, hit rate 69%, TTFT p50 5.6 s): without late binding a hot prefix does
  not stay on its holder, whatever the state's accuracy. The first version of this oracle (an HTTP probe per
  worker per request, 36-349 ms a decision, no FIFO; bench/results/2026-12-02-quality-oracles.md) was no
  bound for that reason and for its decision time.
- zipf_hot: kvroute's default has the lowest TTFT p99 (155 ms; the oracles 182-494 ms).
- `ttft` (greedy on predicted TTFT) copies prefixes more than the kv_aware scorings and has the highest p99
  of the three in both families.

Handicaps, one at a time, to find what kvroute misses (bench/results/2026-12-02-quality-kv_pressure-95-
oracle-ablation.md): `--stale-s 0.25` decides on the state as of every 0.25 s (a report interval),
`--admit-loose` counts an engine as admitting when nothing waited there, whatever was sent since (kvroute's
rule), `--sent-prefix` counts a prefix where it was sent (kvroute's prefix index). All three together give
kvroute's figures (TTFT p99 836 vs 795 ms); the admission rule alone accounts for most of the gap (660 vs
454 ms), the prefix index for none of it (476 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import random
import time
from collections import deque
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backends.sim import tokens as sim_tokens
from backends.sim.kvcache import block_hashes, leading_run
from backends.sim.presets import Preset, get_preset
from backends.sim.tokens import Prompt, chat_prompt, completion_prompt
from bench.oracle_view import Sent, WorkerView, effective_cached, kv_aware_cost, owned_blocks, predict_ttft_s

log = logging.getLogger("kvroute.bench.oracle")
WORKER_HEADER = "x-kvroute-worker"
FEED_CONNECT_S = 30.0  # how long the oracle waits for every worker's first feed line at start


def _memoize_tokenizer() -> None:
    """In this process only: remember the sim tokenizer's answers for texts and images seen before (the shared
    system prompts and images come back all the time), so the oracle's own CPU does not queue requests."""
    text, image = sim_tokens.text_token_ids, sim_tokens.image_placeholder
    text_cached = functools.lru_cache(maxsize=8192)(lambda t: tuple(text(t)))
    sim_tokens.text_token_ids = lambda t: text_cached(t) if len(t) > 64 else text(t)  # type: ignore[assignment]
    sim_tokens.image_placeholder = functools.lru_cache(maxsize=1024)(image)  # type: ignore[assignment]


POLICIES = ("ttft", "kv_aware", "kv_aware_owner")


class Oracle:
    def __init__(self, urls: list[str], policy: str = "ttft", hold: bool = True, stale_s: float = 0.0,
                 admit_loose: bool = False, sent_prefix: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"oracle policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.hold = hold
        self.admit_loose = admit_loose
        self.sent_prefix = sent_prefix
        self.workers = [WorkerView(u, stale_s) for u in urls]
        self.presets: dict[str, Preset] = {}
        self.rng = random.Random(0)
        self.session: aiohttp.ClientSession | None = None
        self._followers: list[asyncio.Task[None]] = []
        self.decision_s: list[float] = []  # scoring time per request (after any hold)
        self.held = 0  # requests that waited in the admission FIFO
        self._fifo: dict[str, deque[asyncio.Future[None]]] = {}  # per model: held requests, oldest first
        self._releasing: set[str] = set()  # models whose released head has not been sent yet

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600))
        self._followers = [asyncio.create_task(self._follow(w)) for w in self.workers]
        await asyncio.wait_for(asyncio.gather(*(w.synced.wait() for w in self.workers)), FEED_CONNECT_S)

    async def stop(self, _app: web.Application) -> None:
        for task in self._followers:
            task.cancel()
        if self.session:
            await self.session.close()

    async def _follow(self, w: WorkerView) -> None:
        """Apply the worker's feed as it comes (reconnecting after a break; the first line resets the mirror)."""
        assert self.session is not None
        while True:
            try:
                async with self.session.get(w.url + "/sim/feed", timeout=aiohttp.ClientTimeout(
                        total=None, connect=5, sock_read=None)) as resp:
                    rest = b""
                    async for chunk in resp.content.iter_any():
                        *lines, rest = (rest + chunk).split(b"\n")
                        for line in lines:
                            w.apply(orjson.loads(line))
                        if lines:
                            self._release(w.model)
            except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
                log.warning("feed of %s broke (%s); reconnecting", w.url, exc)
            await asyncio.sleep(0.2)

    @staticmethod
    def prompt_of(body: dict[str, Any]) -> Prompt:
        """The prompt by the sim's own rules (token ids and image spans)."""
        return chat_prompt(body["messages"]) if "messages" in body else completion_prompt(body.get("prompt", ""))

    async def models(self, _request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "oracle"} for m in sorted({w.model for w in self.workers})]
        return web.json_response({"object": "list", "data": data})

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    def view(self, w: WorkerView, hashes: list[int], prompt: Prompt) -> dict[str, Any]:
        """What a probe of the worker's engine would answer for this prompt, from the mirror."""
        bs = w.block_size
        if self.sent_prefix:  # kvroute's prefix index: a prefix counts where it was sent, evicted there or not
            cached = pending = owned_blocks(w.sent_blocks, hashes) * bs
        else:
            cached = leading_run(hashes, w.cached) * bs
            pending = w.pending_prefix_blocks(hashes) * bs
        eff = max(cached, pending)
        return {**w.queues, "preset": w.preset, "prompt_tokens": len(prompt.token_ids), "cached_tokens": cached,
                "pending_prefix_tokens": eff,
                "media_tokens_uncached": sum(max(0, a + n - max(a, eff)) for a, n in prompt.media_spans)}

    def score(self, w: WorkerView, p: dict[str, Any], hashes: list[int], unseen: list[Sent]) -> float:
        eff = effective_cached(p)
        if self.policy == "kv_aware_owner":
            return kv_aware_cost(p, max(eff, owned_blocks(w.sent_blocks, hashes) * w.block_size), unseen)
        if self.policy == "kv_aware":
            return kv_aware_cost(p, eff, unseen)
        preset = self.presets.get(p["preset"]) or self.presets.setdefault(p["preset"], get_preset(p["preset"]))
        return predict_ttft_s(preset, p, sum(s.uncached_tokens for s in unseen), sum(s.blocks for s in unseen))

    def _admits(self, candidates: list[WorkerView]) -> bool:
        """Whether some candidate engine starts a request at its next step (nothing waiting there, nothing
        sent there that it has not received); with one candidate its own queue is as good as holding."""
        if self.admit_loose:  # kvroute's rule: nothing waiting at the last report, whatever was sent since
            return len(candidates) == 1 or any(not w.queues["waiting"] for w in candidates)
        return len(candidates) == 1 or any(not w.queues["waiting"] and not w.unseen() for w in candidates)

    def _release(self, model: str) -> None:
        """Let the head of the model's FIFO go if an engine admits now; the released request's own send
        calls this again, so the FIFO moves one request per freed engine, in arrival order."""
        fifo = self._fifo.get(model)
        while fifo and fifo[0].done():  # its client left
            fifo.popleft()
        if not fifo or model in self._releasing or not self._admits([w for w in self.workers if w.model == model]):
            return
        self._releasing.add(model)
        fifo.popleft().set_result(None)

    async def _hold(self, model: str) -> None:
        """Wait in the model's FIFO (late binding: the request goes where an engine frees room first)."""
        future = asyncio.get_running_loop().create_future()
        self._fifo.setdefault(model, deque()).append(future)
        self.held += 1
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():  # released, but it will not be sent: pass it on
                self._releasing.discard(model)
                self._release(model)
            raise

    async def forward(self, request: web.Request) -> web.StreamResponse:
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
        released = False
        if self.hold and (self._fifo.get(model) or not self._admits(candidates)):  # arrivals never jump the queue
            await self._hold(model)
            released = True
        t0 = time.perf_counter()
        chains: dict[int, list[int]] = {}  # the prompt's reusable full blocks, hashed once per block size
        best: tuple[float, int, WorkerView, dict[str, Any]] | None = None
        ties = 0
        for w in candidates:
            bs, n = w.block_size, len(prompt.token_ids)
            hashes = chains.get(bs)
            if hashes is None:
                hashes = chains[bs] = block_hashes(prompt.token_ids, bs, max(0, n - 1) // bs)
            p = self.view(w, hashes, prompt)
            unseen = w.unseen()
            key = (self.score(w, p, hashes, unseen), len(p["running"]) + len(p["waiting"]) + len(unseen))
            if best is None or key < best[:2]:
                best, ties = (*key, w, p), 1
            elif key == best[:2]:  # ties at random (reservoir sampling), not to the first worker listed
                ties += 1
                if self.rng.random() * ties < 1.0:
                    best = (*key, w, p)
        assert best is not None
        _, _, w, p = best
        uncached = max(1, p["prompt_tokens"] - effective_cached(p))
        sent = Sent(uncached, -(-uncached // w.block_size), chains[w.block_size])
        w.note_sent(sent)
        if self.policy == "kv_aware_owner" or self.sent_prefix:
            w.sent_blocks.update(sent.hashes)
        self.decision_s.append(time.perf_counter() - t0)
        if released:
            self._releasing.discard(model)
        self._release(model)  # the next waiter, if another engine admits too
        return await self._relay(request, w, raw, sent)

    async def stats(self, _request: web.Request) -> web.Response:
        """How long the oracle's decisions took (wall seconds): its own overhead, apart from its routing."""
        xs = sorted(self.decision_s)
        p50, p99 = (xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None for q in (0.5, 0.99))
        return web.json_response({"decisions": len(xs), "p50_s": p50, "p99_s": p99, "held": self.held})

    async def _relay(self, request: web.Request, w: WorkerView, raw: bytes, sent: Sent) -> web.StreamResponse:
        assert self.session is not None
        enqueued = False
        try:
            async with self.session.post(w.url + request.path, data=raw,
                                         headers={"Content-Type": "application/json"}) as up:
                enqueued = up.status == 200  # the sim refuses (4xx/5xx) before its scheduler sees a request
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
            w.note_done(sent, enqueued)
            self._release(w.model)


def build_app(oracle: Oracle) -> web.Application:
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
    p.add_argument("--send-now", action="store_true",
                   help="no admission FIFO: every request is sent at once, even when every engine is queueing")
    p.add_argument("--stale-s", type=float, default=0.0,
                   help="decide on the feed's state as of its last publication every STALE_S seconds (a report "
                        "interval), not as of the engine's last step")
    p.add_argument("--admit-loose", action="store_true",
                   help="an engine admits when nothing waited there at the last publication (kvroute's rule), "
                        "not counting what was sent there since")
    p.add_argument("--sent-prefix", action="store_true",
                   help="a prefix counts as cached where it was sent (kvroute's prefix index), not where the "
                        "engine holds it")
    p.add_argument("urls", nargs="+", help="sim worker base URLs")
    args = p.parse_args()
    import uvloop

    uvloop.install()
    _memoize_tokenizer()
    oracle = Oracle(args.urls, args.policy, not args.send_now, args.stale_s, args.admit_loose, args.sent_prefix)
    web.run_app(build_app(oracle), host=args.host, port=args.port, access_log=None, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
