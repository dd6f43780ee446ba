"""The simulator's OpenAI-compatible HTTP server: vLLM's routes over the sim engine.

Owns the aiohttp routes and the fault flags; the process around it (flags, registration and reports, drain
on SIGTERM) is process.py's, engine behaviour engine.py's/scheduler.py's, wire shapes openai_api.py's.

Faults: --fail-rate answers that fraction of completion requests with HTTP 500; --crash-after N
serves N completion requests and exits abruptly (os._exit(1), no drain) when request N+1 arrives;
--stall-after N freezes the engine once request N+1 is admitted (no more tokens for anyone, while
/health still answers, like a hung GPU); --slow-start S waits S wall seconds before listening.
Besides vLLM's routes it serves GET /sim/state: the engine's internals as JSON, for tests and benchmarks,
and GET /sim/feed: the prefix cache and the queues, pushed at every engine step (feed.py; bench/oracle.py).
Roles (--role, --kv-transfer): a worker with a KV connector keeps a `do_remote_decode` request's blocks for a
decode worker and pulls a `do_remote_prefill` request's from its prefill worker (transfer.py); an encode worker
runs only the vision tower (encoder.py), and the others fetch its output when `ec_transfer_params` name it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
import time
from typing import Any

import orjson
from aiohttp import web

from backends.reporter import Load
from backends.sim.encoder import EncoderCounters, EncoderOutputs, SimEncoder
from backends.sim.engine import SimEngine
from backends.sim.feed import StateFeed
from backends.sim.kv_publisher import SimKvEvents, add_kv_event_routes
from backends.sim.metrics import CONTENT_TYPE, SimMetrics
from backends.sim.openai_api import (
    ApiError,
    ParsedRequest,
    ResponseBuilder,
    error_body,
    new_request_id,
    parse_request,
)
from backends.sim.presets import Preset
from backends.sim.scheduler import SimRequest
from backends.sim.tokens import chat_prompt, completion_prompt, exact_prompt, public_token_ids
from backends.sim.transfer import (
    KvHolder,
    KvPuller,
    TransferCounters,
    wants_remote_decode,
    wants_remote_prefill,
)

log = logging.getLogger("kvroute.sim.server")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _sse(chunk: dict[str, Any] | None) -> bytes:
    return b"" if chunk is None else b"data: " + orjson.dumps(chunk) + b"\n\n"


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    return _json(error_body(status, message, err_type, param), status)


def _cached_tokens(request: SimRequest, params: object) -> int:
    """The prompt tokens its answer reports cached: a decode worker reports the prefill worker's hit, as vLLM does."""
    remote = params.get("remote_prefill_cached_tokens") if wants_remote_prefill(params) else None  # type: ignore[union-attr]
    return remote if isinstance(remote, int) else request.num_cached_tokens


class SimServer:
    """One simulated worker: engine + HTTP surface + fault injection + drain state."""

    def __init__(self, preset: Preset, served_model_name: str, time_scale: float = 1.0, seed: int = 0,
                 fail_rate: float = 0.0, crash_after: int | None = None, stall_after: int | None = None,
                 role: str = "both", kv_transfer: dict[str, Any] | None = None,
                 ec_transfer: dict[str, Any] | None = None, counter: Any = None) -> None:
        self.preset = preset
        self.role = role
        self.counter = counter  # --tokenizer: a real tokenizer's PromptCounter (proxy/tokens), else None
        self.model = served_model_name
        self.engine = SimEngine(preset, time_scale)
        self.metrics = SimMetrics(self.engine, served_model_name)
        self.seed = seed
        self.fail_rate = fail_rate
        self.crash_after = crash_after
        self.stall_after = stall_after
        self.draining = False
        self.in_flight = 0
        self.requests_received = 0
        self.feed = StateFeed(self.engine, served_model_name, preset.name)
        self.kv_events: SimKvEvents | None = None  # set by serve(): the publisher of vLLM-format KV events
        self.idle = asyncio.Event()
        self.idle.set()
        self._rng = random.Random(seed)
        self.created = int(time.time())
        # disaggregated serving: none of it without a connector, as vLLM ignores the params then
        link_name = str((kv_transfer or {}).get("link") or "rdma-400g")
        self.transfer = TransferCounters()
        self.encoder_counters = EncoderCounters()
        self.holder: KvHolder | None = None
        self.puller: KvPuller | None = None
        if kv_transfer is not None and role != "encode":
            extra, options = kv_transfer.get("extra") or {}, kv_transfer.get("options") or {}
            lease_s = float(extra.get("kv_lease_duration", 30))
            self.holder = KvHolder(self.engine, link_name, self.transfer, lease_s)
            self.puller = KvPuller(self.engine, link_name, self.transfer, lease_s=lease_s,
                                   recompute_on_failure=options.get("kv_load_failure_policy") == "recompute")
        self.encoder = SimEncoder(preset, time_scale, link_name, self.encoder_counters) if role == "encode" else None
        self.encoder_outputs = (EncoderOutputs(link_name, time_scale, self.encoder_counters)
                                if ec_transfer is not None and role != "encode" else None)
        self.metrics.add_disagg(self.holder, self.transfer, self.encoder_counters)

    def set_endpoint(self, host: str, port: int) -> None:
        """Where other workers reach this one for KV and encoder output (the address it registers)."""
        for side in (self.holder, self.encoder):
            if side is not None:
                side.endpoint = (host, port)

    # ---- app -----------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)  # base64 images are large
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/load", self.load)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/sim/state", self.state)
        app.router.add_get("/sim/feed", self.feed.handle)
        for side in (self.holder, self.encoder):
            if side is not None:
                side.add_routes(app)
        add_kv_event_routes(app, self.engine, lambda: self.kv_events)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.engine.start()

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.engine.stop()
        for side in (self.puller, self.encoder_outputs):
            if side is not None:
                await side.close()

    # ---- simple routes -------------------------------------------------------------------------
    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": self.engine.max_model_len,
                "permission": []}
        return _json({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.Response:
        if self.draining:
            return _error(503, "worker is draining", "ServiceUnavailableError")
        return web.Response(status=200)

    async def load(self, _request: web.Request) -> web.Response:
        return _json({"server_load": self.in_flight})

    async def version(self, _request: web.Request) -> web.Response:
        return _json({"version": "kvroute-sim", "preset": self.preset.name})

    async def metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def state(self, _request: web.Request) -> web.Response:
        """The engine's internal state, for tests and operators (not part of vLLM's API)."""
        return _json(self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        sched, kv = self.engine.scheduler, self.engine.kv
        return {
            "preset": self.preset.name, "model": self.model, "time_scale": self.engine.time_scale,
            "sim_time_s": self.engine.now(), "busy_sim_s": self.engine.busy_sim_s, "lag_sim_s": self.engine.lag_sim_s,
            "steps": self.engine.num_steps,
            "num_blocks": kv.num_blocks, "block_size": kv.block_size, "used_blocks": kv.num_used_blocks,
            "cached_blocks": kv.num_cached_blocks, "kv_cache_usage": kv.usage,
            "kv_capacity_tokens": kv.num_blocks * kv.block_size, "max_model_len": self.engine.max_model_len,
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions, "num_finished": sched.num_finished,
            "generated_tokens": sched.num_generated_tokens,
            "prefix_cache_queries": sched.prefix_queries_tokens, "prefix_cache_hits": sched.prefix_hit_tokens,
            "preempted_prefix_cache_queries": sched.preempted_queries_tokens,
            "preempted_prefix_cache_hits": sched.preempted_hit_tokens,
            "prefix_cache_hit_rate": sched.recent_prefix_hit_rate, "in_flight": self.in_flight,
            "requests_received": self.requests_received, "draining": self.draining, "stalled": self.engine.stalled,
            "role": self.role, "blocks_held_for_transfer": self.holder.blocks_held if self.holder else 0,
            "requests_held_for_transfer": self.holder.requests_held if self.holder else 0,
            "awaiting_remote_kv": len(sched.awaiting_kv), "kv_transfer": vars(self.transfer),
            "encoder": {**vars(self.encoder_counters),
                        "cached_items": len(self.encoder.cache) if self.encoder else 0},
        }

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            chat = "messages" in body
            prompt = exact_prompt(self.counter, body, chat) if self.counter is not None else None
            if prompt is None and chat:
                prompt = chat_prompt(body["messages"], bool(body.get("add_generation_prompt", True)))
            elif prompt is None:
                prompt = completion_prompt(body.get("prompt", ""))
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
            return _error(400, f"cannot tokenize: {exc}", "BadRequestError")
        tokens = public_token_ids(prompt.token_ids)
        return _json({"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens,
                      "token_strs": None})

    # ---- completions ---------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    def _admit(self) -> web.Response | None:
        """Drain and fault checks, before the body is read. A response means: answer with it."""
        if self.draining:
            return _error(503, "worker is draining; send new requests elsewhere", "ServiceUnavailableError")
        self.requests_received += 1
        if self.crash_after is not None and self.requests_received > self.crash_after:
            log.error("--crash-after %d reached: exiting abruptly", self.crash_after)
            sys.stderr.flush()
            os._exit(1)
        if self.stall_after is not None and self.requests_received > self.stall_after and not self.engine.stalled:
            log.warning("--stall-after %d reached: the engine stops producing tokens", self.stall_after)
            self.engine.set_stalled(True)
        if self.fail_rate > 0 and self._rng.random() < self.fail_rate:
            return _error(500, "simulated engine failure (--fail-rate)", "InternalServerError")
        return None

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        refused = self._admit()
        if refused is not None:
            return refused
        try:
            body = orjson.loads(await request.read())
            parsed = parse_request(body, kind, self.model, self.engine.max_model_len,
                                   default_seed=hash((self.seed, self.requests_received)) & 0x7FFFFFFF,
                                   counter=self.counter)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON body: {exc}", "BadRequestError")
        except ApiError as exc:
            self._release_refused(body)
            return _json(exc.body(), exc.status)
        request_id = new_request_id(kind)
        sim_request = SimRequest(request_id, parsed.prompt, parsed.max_tokens, seed=parsed.seed,
                                 finish_reason=parsed.finish_reason)
        self.in_flight += 1
        self.idle.clear()
        try:
            if self.encoder is not None:
                return await self._encode_only(request_id, parsed)
            if self.encoder_outputs is not None:
                sim_request.encoded_media = await self.encoder_outputs.fetch(parsed.prompt, parsed.ec_transfer_params)
            params = parsed.kv_transfer_params
            sim_request.hold_kv = self.holder is not None and wants_remote_decode(params)
            if self.puller is not None and wants_remote_prefill(params):
                sim_request.remote_kv = dict(params)  # type: ignore[arg-type]  # checked: a dict
            queue = self.engine.submit(sim_request)
            if sim_request.remote_kv is not None and self.puller is not None:
                self.puller.track(sim_request)
            builder = ResponseBuilder(request_id, parsed)
            if parsed.stream:
                return await self._stream(request, parsed, builder, sim_request, queue)
            pieces: list[str] = []
            while True:
                event = await queue.get()
                pieces.append(event.text)
                if event.finished:
                    break
            if sim_request.failed:  # its KV could not be loaded (vLLM's kv_load_failure_policy "fail")
                return _error(500, "Internal server error", "InternalServerError")
            held = self.holder.params(sim_request) if self.holder is not None and sim_request.hold_kv else None
            return _json(builder.full_response("".join(pieces), parsed.finish_reason, sim_request.num_prompt_tokens,
                                               sim_request.num_output_tokens, _cached_tokens(sim_request, params),
                                               kv_transfer_params=held))
        finally:
            # normal end, client disconnect (handler cancelled) or a write error: the engine lets go
            self.engine.abort(sim_request)
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    def _release_refused(self, body: Any) -> None:
        """A refused request that names a prefill worker's KV frees it there at once (vLLM 0.32 notifies its
        connector for every remote-prefill request its serving layer refuses; the proxy releases KV this way)."""
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if self.puller is not None and wants_remote_prefill(params):
            self.puller.release(dict(params))  # type: ignore[arg-type]  # checked: a dict

    async def _stream(self, request: web.Request, parsed: ParsedRequest, builder: ResponseBuilder,
                      sim_request: SimRequest, queue: asyncio.Queue) -> web.StreamResponse:
        # vLLM answers with its head before the engine has the request, and sends its first chunk (the role)
        # only when the engine's first output, the first token, arrives: a client timing the first chunk
        # sees the engine's TTFT
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        prompt_tokens = sim_request.num_prompt_tokens
        try:
            sent = 0
            while True:
                event = await queue.get()
                if sim_request.failed:
                    await response.write(_sse(error_body(500, "Internal server error", "InternalServerError")))
                    break
                data = b""
                if sent == 0:
                    data = _sse(builder.role_chunk(prompt_tokens if parsed.continuous_usage else None))
                sent += 1
                running = (prompt_tokens, sent) if parsed.continuous_usage else None
                data += _sse(builder.token_chunk(event.text, parsed.finish_reason if event.finished else None,
                                                 running))
                await response.write(data)
                if event.finished:
                    break
            if parsed.include_usage and not sim_request.failed:
                await response.write(_sse(builder.usage_chunk(prompt_tokens, sim_request.num_output_tokens,
                                                              _cached_tokens(sim_request, parsed.kv_transfer_params))))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client left mid-stream: the caller aborts the request
            log.debug("client of %s went away after %d tokens", sim_request.request_id, sim_request.num_output_tokens)
        return response

    async def _encode_only(self, request_id: str, parsed: ParsedRequest) -> web.StreamResponse:
        """An encode worker's answer: the vision tower's work, no tokens, where to fetch each output."""
        items = await self.encoder.encode(parsed.prompt)  # type: ignore[union-attr]  # the caller checked
        body = ResponseBuilder(request_id, parsed).full_response(
            "", "stop", len(parsed.prompt.token_ids), 0, 0, ec_transfer_params=items or None)
        return _json(body)

    # ---- load for the proxy --------------------------------------------------------------------
    async def load_reading(self) -> Load:
        """The LoadSource handed to ProxyReporter: read straight from the engine, no /metrics round trip."""
        sched, speed, scale = self.engine.scheduler, self.engine.speed, self.engine.time_scale
        # the proxy measures wall time: a simulated second lasts 1 / time_scale wall seconds
        prefill_rate, decode_step = speed.prefill_tokens_per_s, speed.decode_step_s
        if self.encoder is not None:  # no KV: its load is the vision tower's queue
            busy = self.encoder.busy
            return Load(kv_cache_usage=0.0, num_running=min(busy, 1), num_waiting=max(busy - 1, 0),
                        kv_capacity_tokens=self.engine.kv.num_blocks * self.engine.kv.block_size)
        return Load(kv_cache_usage=self.engine.kv.usage, num_running=len(sched.running),
                    num_waiting=sched.num_waiting, prefix_cache_hit_rate=sched.recent_prefix_hit_rate,
                    kv_capacity_tokens=self.engine.kv.num_blocks * self.engine.kv.block_size,
                    prefill_tokens_per_s=prefill_rate * scale if prefill_rate else None,
                    decode_step_s=decode_step / scale if decode_step else None,
                    max_num_batched_tokens=sched.max_num_batched_tokens,
                    prompt_tokens_total=sched.num_prompt_tokens, generation_tokens_total=sched.num_generated_tokens,
                    preemptions_total=sched.num_preemptions)
