"""Limits against hostile or broken callers on the aiohttp side: request shape, headers, bodies.

Owns the effective limits (proxy.limits, models[].limits overrides, defaults), the per-request
shape check after parse and the header/body/budget middleware of the control-plane app. The data
plane (proxy/dataplane/) enforces the same config on its own connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from proxy.config import FleetConfig, ProxyLimits, RequestLimits
from proxy.errors import ProxyError, error_response, request_too_large
from proxy.request import RoutedRequest, image_size_from_data_url

log = logging.getLogger("kvroute.limits")

# Defaults of the request-shape limits left unset in config (documented in config.RequestLimits).
DEFAULT_REQUEST_LIMITS = {"max_messages": 2048, "max_images": 64, "max_videos": 8,
                          "max_image_pixels": 16 * 16_777_216, "max_tokens": None}
# aiohttp's own parser limits sit this many times above ours: between the two the middleware
# answers 431; past aiohttp's, aiohttp answers 400 itself.
PARSER_BACKSTOP = 4
_WORKER_REGISTRATION_PATHS = ("/workers", "/nodes/add")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def effective_limits(config: FleetConfig, served: str | None) -> dict[str, Any]:
    """Request-shape limits for a served model: its own, else proxy.limits, else the defaults."""
    out = dict(DEFAULT_REQUEST_LIMITS)
    layers: list[RequestLimits] = [config.proxy.limits]
    model = config.model(served) if served else None
    if model is not None:
        layers.append(model.limits)
    for layer in layers:
        for name in DEFAULT_REQUEST_LIMITS:
            value = getattr(layer, name)
            if value is not None:
                out[name] = value
    return out


def check_request(routed: RoutedRequest, config: FleetConfig, served: str) -> None:
    """ProxyError 400 when a parsed request exceeds its model's shape limits."""
    limits = effective_limits(config, served)
    payload = routed.payload
    cap = limits["max_tokens"]
    if cap is not None:
        for param in ("max_tokens", "max_completion_tokens"):
            value = payload.get(param)
            if isinstance(value, int) and value > cap:
                raise ProxyError(400, f"`{param}` is {value}; this proxy allows at most {cap} for `{served}`.",
                                 code="max_tokens_exceeded", param=param)
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > limits["max_messages"]:
        raise ProxyError(400, f"{len(messages)} messages; this proxy allows at most {limits['max_messages']}.",
                         code="too_many_messages", param="messages")
    if not routed.media_count:
        return
    images = videos = pixels = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            part_type = part.get("type", "text") if isinstance(part, dict) else "text"
            if not isinstance(part_type, str) or part_type == "text":
                continue
            if part_type.startswith("video"):
                videos += 1
            elif part_type.startswith("image"):
                images += 1
                pixels += _known_pixels(part, part_type)
    if images > limits["max_images"]:
        raise ProxyError(400, f"{images} images; this proxy allows at most {limits['max_images']} per request.",
                         code="too_many_images", param="messages")
    if videos > limits["max_videos"]:
        raise ProxyError(400, f"{videos} videos; this proxy allows at most {limits['max_videos']} per request.",
                         code="too_many_videos", param="messages")
    if pixels > limits["max_image_pixels"]:
        raise ProxyError(400, f"The images hold {pixels} pixels together; this proxy allows at most "
                              f"{limits['max_image_pixels']} per request.", code="too_many_pixels", param="messages")


def _known_pixels(part: dict[str, Any], part_type: str) -> int:
    value = part.get(part_type)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.startswith("data:"):
        return 0
    size = image_size_from_data_url(url)
    return size[0] * size[1] if size else 0


# --- bytes of bodies in memory -------------------------------------------------------------

class BodyBudget:
    """Bytes of request bodies held at once, all requests together; a body that does not fit waits
    (FIFO by wake-up) up to `wait_s`, then is refused 503."""

    def __init__(self, capacity: int, wait_s: float) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.held = 0
        self.waiting = 0
        self._changed = asyncio.Condition()
        self._since_trim = 0  # body bytes held since the heap was last trimmed
        self._trim: asyncio.TimerHandle | None = None

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        nbytes = min(nbytes, self.capacity)
        if self.held + nbytes > self.capacity:
            self.waiting += 1
            try:
                async with self._changed:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.held + nbytes <= self.capacity),
                                           self.wait_s)
            except TimeoutError:
                raise ProxyError(503, "The proxy holds as many request bodies as it may right now; retry shortly.",
                                 "service_unavailable", code="body_memory_full", headers={"Retry-After": "1"}) from None
            finally:
                self.waiting -= 1
        self.held += nbytes
        self._since_trim += nbytes
        try:
            yield
        finally:
            self.held -= nbytes
            if self.held == 0 and self._since_trim >= TRIM_AFTER_BYTES and self._trim is None:
                # the burst is over: once its bodies are garbage, give the heap's free pages back
                self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim_heap)
            if self.waiting:
                async with self._changed:
                    self._changed.notify_all()


    def _trim_heap(self) -> None:
        self._trim = None
        if self.held == 0:
            self._since_trim = 0
            # a few ms on a large heap: off the event loop (ctypes lets go of the GIL; glibc locks its arenas)
            asyncio.get_running_loop().run_in_executor(None, trim_freed_memory)


# --- middleware ----------------------------------------------------------------------------

def limits_middleware(config: FleetConfig, registry: Any, authenticate: Callable[[Any], object] | None = None,
                      budget: BodyBudget | None = None) -> Handler:
    """Header count/size (431), the body memory budget (wait or 503), the body read deadline (408),
    and the cap on registered workers (503). `authenticate(authorization)` runs before a /v1 body is
    read, so an unknown caller costs no body read."""
    limits: ProxyLimits = config.proxy.limits
    max_body = config.proxy.max_body_bytes
    budget = budget or BodyBudget(limits.max_buffered_body_bytes, limits.buffered_body_wait_s)

    @web.middleware
    async def enforce_limits(request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = request.raw_headers
        if len(raw) > limits.max_headers:
            return _too_many_headers(f"{len(raw)} header fields; at most {limits.max_headers} are accepted.")
        size = sum(len(k) + len(v) + 4 for k, v in raw)
        if size > limits.max_header_bytes:
            return _too_many_headers(f"The headers hold {size} bytes; at most {limits.max_header_bytes} "
                                     f"are accepted.")
        if not request.body_exists:
            return await handler(request)
        length = request.content_length
        if length is not None and length > max_body:
            return await handler(request)  # refused unread by the handler's own 413
        try:
            if authenticate is not None and request.path.startswith("/v1/"):
                authenticate(request.headers.get("Authorization"))
            async with budget.hold(length if length is not None else max_body):
                try:
                    async with asyncio.timeout(limits.body_read_timeout_s):  # no extra task, unlike wait_for
                        body = await request.read()
                except TimeoutError:
                    return error_response(408, f"The request body did not arrive within "
                                               f"{limits.body_read_timeout_s:g}s.", code="body_timeout",
                                          headers={"Connection": "close"})
                except web.HTTPRequestEntityTooLarge:
                    return request_too_large(max_body).response()
                if request.method == "POST" and request.path in _WORKER_REGISTRATION_PATHS:
                    _check_worker_cap(registry, limits.max_workers, body)
                return await handler(request)
        except ProxyError as exc:
            return exc.response()

    enforce_limits.budget = budget  # type: ignore[attr-defined]  # for tests and /metrics
    return enforce_limits


def _too_many_headers(message: str) -> web.Response:
    return error_response(431, message, code="request_header_fields_too_large", headers={"Connection": "close"})


def _check_worker_cap(registry: Any, max_workers: int, body: bytes) -> None:
    known = {w.worker_id for w in registry.workers()}
    if len(known) < max_workers:
        return
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return  # the route itself answers 400
    worker_id = payload.get("worker_id") if isinstance(payload, dict) else None
    if worker_id not in known:  # a re-registration replaces its entry and adds nothing
        raise ProxyError(503, f"The proxy has {len(known)} workers registered, its limit; remove one first.",
                         "service_unavailable", code="too_many_workers", headers={"Retry-After": "5"})


def parser_limits(config: FleetConfig) -> dict[str, int]:
    """aiohttp's own header limits (AppRunner kwargs), set well above ours as a backstop."""
    limits = config.proxy.limits
    return {"max_headers": limits.max_headers * PARSER_BACKSTOP,
            "max_field_size": max(8190, limits.max_header_bytes * PARSER_BACKSTOP),
            "max_line_size": max(8190, limits.max_header_bytes * PARSER_BACKSTOP)}


# --- memory --------------------------------------------------------------------------------

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 1024 * 1024


# After a burst of this many body bytes the heap is trimmed (see trim_freed_memory), TRIM_DELAY_S after
# the last of them is released (the request objects go a moment after their bodies' budget).
TRIM_AFTER_BYTES = 8 * 1024 * 1024
TRIM_DELAY_S = 0.2


def trim_freed_memory() -> None:
    """glibc's malloc_trim(0): hand the heap's free pages back to the OS. A body of 1 MiB or more is
    mmapped (return_large_frees_to_the_os) but the pieces it was read in are not; after a burst of large
    bodies they leave free holes the heap cannot shrink past (the proxy stayed ~40-60 MiB above its
    baseline in about one run in six). A few ms for a heap of hundreds of MiB; nothing where not glibc."""
    libc = _libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:
            pass


@functools.cache
def _libc() -> Any:
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def return_large_frees_to_the_os() -> bool:
    """Make glibc serve every allocation of 1 MiB or more with its own mmap, for the whole process.

    glibc's default raises its mmap threshold to the largest block freed so far (up to 32 MiB), so
    after one burst of large bodies later ones land in the heap and stay there: 12 bodies of 24 MB
    left the proxy at 400 MB RSS instead of its 62 MB baseline. A fixed threshold disables that
    adjustment and freed bodies go back to the OS at once. Call at process start; False where the
    C library is not glibc (nothing changes).
    """
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except AttributeError:
        return False
