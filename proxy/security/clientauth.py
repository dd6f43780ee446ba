"""Client API keys for /v1/*: who is calling (authenticate) and whether they may now (admit).

Owns key loading (config list or file, --api-keys, KVROUTE_API_KEYS), the SHA-256 key table,
per-key model allowlists and token-bucket rate limits (local, or shared through Redis).
It does not own control-plane tokens (admin/worker) nor request-shape limits (limits.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from aiohttp import web

from proxy.config import ApiKey, FleetConfig, StateConfig
from proxy.errors import ProxyError, error_response

log = logging.getLogger("kvroute.clientauth")

# Lowercase names of the headers that carry a client's credentials; never forwarded to a worker.
# (x-kvroute-admin-token: the admin token beside a client key, for x-kvroute-debug; observability/decision.py)
CLIENT_CREDENTIAL_HEADERS: frozenset[str] = frozenset(
    {"authorization", "api-key", "x-api-key", "cookie", "proxy-authorization", "x-kvroute-admin-token"})
API_KEYS_ENV = "KVROUTE_API_KEYS"
RATE_KEY = "kvroute:ratelimit:{}"  # Redis hash per key: both buckets' levels and last refill time
# A Redis that fails makes the limiter use its local buckets for this long before trying again.
REDIS_RETRY_S = 5.0


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request: a configured key (by name), or anonymous when no keys are configured."""

    name: str
    key_id: str                          # first 12 hex digits of the key's SHA-256: safe to log
    models: frozenset[str] | None = None  # None: every model
    requests_per_s: float | None = None
    tokens_per_min: float | None = None
    limited: bool = field(default=False)  # has a rate limit (admit must consult buckets)


ANONYMOUS = Principal(name="anonymous", key_id="")


def _unauthorized(message: str) -> ProxyError:
    return ProxyError(401, message, "invalid_request_error", code="invalid_api_key",
                      headers={"WWW-Authenticate": 'Bearer realm="kvroute"'})


_MISSING = ("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
_INCORRECT = "Incorrect API key provided."


class ClientAuth:
    """The key table and rate limiter of one proxy; `enabled` is False when no key is configured."""

    def __init__(self, keys: Iterable[ApiKey], config: FleetConfig | None = None,
                 metrics_token: str | None = None, redis: StateConfig | None = None,
                 clock=time.monotonic) -> None:
        self._by_digest: dict[bytes, tuple[bytes, Principal]] = {}
        for entry in keys:
            digest = (hashlib.sha256(entry.key.encode()).digest() if entry.key is not None
                      else bytes.fromhex(entry.key_sha256 or ""))
            self._by_digest[digest] = (digest, _principal(entry, digest, config))
        self.enabled = bool(self._by_digest)
        self._metrics_digest = hashlib.sha256(metrics_token.encode()).digest() if metrics_token else None
        self._limiter = RateLimiter(redis, clock)

    @classmethod
    def from_config(cls, config: FleetConfig, env: Mapping[str, str] | None = None) -> ClientAuth:
        """Keys from proxy.api_keys (list or file) plus KVROUTE_API_KEYS; raises ValueError for a bad file.

        Reads the key file: call at start-up.
        """
        env = os.environ if env is None else env
        keys = load_keys(config.proxy.api_keys)
        keys += [ApiKey(key=k.strip()) for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
        return cls(keys, config, metrics_token=config.proxy.metrics_token or None,
                   redis=config.state if config.state.url != "memory" else None)

    # --- who ---------------------------------------------------------------------------------
    def authenticate(self, authorization: str | bytes | None) -> Principal:
        """The caller behind an Authorization header value; ProxyError 401 when keys are configured
        and the bearer key is missing or unknown. Never raises anything else."""
        if not self.enabled:
            return ANONYMOUS
        principal = self._lookup(authorization)
        if principal is None:
            raise _unauthorized(_MISSING if not authorization else _INCORRECT)
        return principal

    def may_read_metrics(self, authorization: str | bytes | None) -> bool:
        """GET /metrics: open without keys or metrics token; else any valid key or the metrics token."""
        if not self.enabled and self._metrics_digest is None:
            return True
        digest = _bearer_digest(authorization)
        if digest is None:
            return False
        if self._metrics_digest is not None and hmac.compare_digest(digest, self._metrics_digest):
            return True
        return digest in self._by_digest

    def _lookup(self, authorization: str | bytes | None) -> Principal | None:
        digest = _bearer_digest(authorization)
        if digest is None:
            return None
        # The table is keyed by SHA-256 digests: a lookup reveals nothing useful about any key's
        # bytes through timing, and the final comparison is constant-time as well.
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return None
        return found[1]

    # --- may they, now -----------------------------------------------------------------------
    async def admit(self, principal: Principal, model: str, estimated_tokens: int) -> None:
        """ProxyError 403 when the key may not use `model` (the served name or the requested alias),
        429 with Retry-After when its rate limit is spent. Returns at once for unlimited callers."""
        if principal.models is not None and model not in principal.models:
            raise ProxyError(403, f"This API key is not allowed to use model `{model}`.", "invalid_request_error",
                             code="model_not_allowed", param="model")
        if principal.limited:
            wait_s, which = await self._limiter.take(principal, max(0, estimated_tokens))
            if wait_s > 0:
                unit = "requests per second" if which == "requests" else "tokens per minute"
                retry = max(1, math.ceil(wait_s))
                raise ProxyError(429, f"Rate limit reached for this API key ({principal.name}) on {unit}. "
                                      f"Please try again in {wait_s:.2f}s.", which,
                                 code="rate_limit_exceeded", headers={"Retry-After": str(retry)})

    async def close(self) -> None:
        await self._limiter.close()


def _bearer_digest(authorization: str | bytes | None) -> bytes | None:
    if not authorization:
        return None
    if isinstance(authorization, str):
        try:
            raw = authorization.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return None
    else:
        raw = authorization
    if raw[:7].lower() != b"bearer ":
        return None
    key = raw[7:].strip()
    if not key:
        return None
    return hashlib.sha256(key).digest()


def _principal(entry: ApiKey, digest: bytes, config: FleetConfig | None) -> Principal:
    models: frozenset[str] | None = None
    if entry.models:
        names = set(entry.models)
        if config is not None:  # an allowed alias allows its served model, and the reverse
            for name in entry.models:
                configured = config.model(name)
                if configured is not None:
                    names |= {configured.name, *configured.aliases}
        models = frozenset(names)
    key_id = digest[:6].hex()
    return Principal(name=entry.name or f"key-{key_id}", key_id=key_id, models=models,
                     requests_per_s=entry.requests_per_s, tokens_per_min=entry.tokens_per_min,
                     limited=entry.requests_per_s is not None or entry.tokens_per_min is not None)


def load_keys(source: list[ApiKey] | str | None) -> list[ApiKey]:
    """Entries from proxy.api_keys: the list itself, or a file of keys (ValueError when unreadable).

    A file holds either one key per line (`sha256:HEX` for a hashed one; `#` comments), or a YAML
    list whose items are keys or entries like those of proxy.api_keys.
    """
    if source is None:
        return []
    if not isinstance(source, str):
        return list(source)
    path = Path(source)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"api keys file {source}: {exc.strerror}") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if lines and lines[0].startswith(("-", "[")):
        try:
            items = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"api keys file {source}: invalid YAML: {exc}") from None
        if not isinstance(items, list):
            raise ValueError(f"api keys file {source}: expected a list of keys")
        out = []
        for i, item in enumerate(items):
            try:
                out.append(ApiKey(key=str(item)) if isinstance(item, (str, int)) else ApiKey.model_validate(item))
            except ValueError as exc:
                raise ValueError(f"api keys file {source}: entry {i}: {exc}") from None
        return out
    return [ApiKey(key_sha256=ln[7:]) if ln.startswith("sha256:") else ApiKey(key=ln) for ln in lines]


# --- rate limits ---------------------------------------------------------------------------

@dataclass(slots=True)
class _Buckets:
    requests: float
    tokens: float
    at: float


# Both buckets of one key, refilled and taken together, atomically. KEYS[1]: the key's hash.
# ARGV: rps, req_capacity, tokens_per_s, tok_capacity, cost (tokens); rate 0 = no such bucket.
# Returns {admitted(0/1), wait in ms, which (1 requests, 2 tokens)}.
_TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rps, rcap, tps, tcap, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
    tonumber(ARGV[4]), tonumber(ARGV[5])
local state = redis.call('HMGET', KEYS[1], 'r', 't', 'at')
local r = tonumber(state[1]) or rcap
local tk = tonumber(state[2]) or tcap
local at = tonumber(state[3]) or now
local dt = math.max(0, now - at)
r = math.min(rcap, r + dt * rps)
tk = math.min(tcap, tk + dt * tps)
local wait, which = 0, 0
if rps > 0 and r < 1 then wait = (1 - r) / rps; which = 1 end
if tps > 0 and tk < cost then
  local w = (cost - tk) / tps
  if w > wait then wait = w; which = 2 end
end
if wait == 0 then
  if rps > 0 then r = r - 1 end
  if tps > 0 then tk = tk - cost end
end
redis.call('HSET', KEYS[1], 'r', r, 't', tk, 'at', now)
redis.call('EXPIRE', KEYS[1], 3600)
if wait > 0 then return {0, math.ceil(wait * 1000), which} end
return {1, 0, 0}
"""


class RateLimiter:
    """Token buckets per key: requests/s (burst of one second) and tokens/min (burst of one minute).

    With a Redis URL every proxy sharing that Redis draws from the same buckets; while Redis fails
    each proxy falls back to its own buckets (a request is never refused because Redis is away).
    """

    def __init__(self, redis: StateConfig | None, clock=time.monotonic) -> None:
        self._local: dict[str, _Buckets] = {}
        self._clock = clock
        self._redis_state = redis
        self._redis = None
        self._script = None
        self._redis_down_until = 0.0

    async def take(self, principal: Principal, tokens: int) -> tuple[float, str]:
        """(0, "") when admitted (and charged); else (seconds to wait, "requests" | "tokens")."""
        rps, rcap, tps, tcap, cost = _bucket_params(principal, tokens)
        if self._redis_state is not None and self._clock() >= self._redis_down_until:
            try:
                return await self._take_redis(principal.key_id, rps, rcap, tps, tcap, cost)
            except Exception as exc:  # any Redis failure: degrade to local limits, never refuse for it
                log.warning("rate limits: redis unavailable (%s); using this proxy's own buckets for %.0fs",
                            exc, REDIS_RETRY_S)
                self._redis_down_until = self._clock() + REDIS_RETRY_S
        return self._take_local(principal.key_id, rps, rcap, tps, tcap, cost)

    def _take_local(self, key_id: str, rps: float, rcap: float, tps: float, tcap: float,
                    cost: float) -> tuple[float, str]:
        now = self._clock()
        b = self._local.get(key_id)
        if b is None:
            b = self._local[key_id] = _Buckets(rcap, tcap, now)
        dt = max(0.0, now - b.at)
        b.requests = min(rcap, b.requests + dt * rps)
        b.tokens = min(tcap, b.tokens + dt * tps)
        b.at = now
        wait, which = 0.0, ""
        if rps > 0 and b.requests < 1:
            wait, which = (1 - b.requests) / rps, "requests"
        if tps > 0 and b.tokens < cost and (cost - b.tokens) / tps > wait:
            wait, which = (cost - b.tokens) / tps, "tokens"
        if wait == 0:
            if rps > 0:
                b.requests -= 1
            if tps > 0:
                b.tokens -= cost
        return wait, which

    async def _take_redis(self, key_id: str, rps: float, rcap: float, tps: float, tcap: float,
                          cost: float) -> tuple[float, str]:
        if self._redis is None:
            from proxy.security.redisconn import redis_client

            assert self._redis_state is not None
            self._redis = redis_client(self._redis_state, connect_timeout_s=1, timeout_s=1)
            self._script = self._redis.register_script(_TAKE_LUA)
        admitted, wait_ms, which = await asyncio.wait_for(
            self._script(keys=[RATE_KEY.format(key_id)], args=[rps, rcap, tps, tcap, cost]), 2.0)
        if int(admitted):
            return 0.0, ""
        return max(0.001, int(wait_ms) / 1000), "requests" if int(which) == 1 else "tokens"

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None


def _bucket_params(principal: Principal, tokens: int) -> tuple[float, float, float, float, float]:
    rps = principal.requests_per_s or 0.0
    rcap = max(1.0, rps)
    tps = (principal.tokens_per_min or 0.0) / 60.0
    tcap = principal.tokens_per_min or 0.0
    # A request larger than the whole minute's budget is admitted once the bucket is full, instead
    # of never: its cost is capped at the capacity.
    cost = float(min(tokens, tcap)) if tps > 0 else 0.0
    return rps, rcap, tps, tcap, cost


def client_keys_middleware(auth: ClientAuth) -> Callable[..., Awaitable[web.StreamResponse]]:
    """aiohttp middleware: /v1/* needs a valid key (checked before any body is read) and GET
    /metrics a key or the metrics token, when keys are configured; everything else passes."""

    @web.middleware
    async def check_client_key(request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        path = request.path
        if path.startswith("/v1/"):
            try:
                auth.authenticate(request.headers.get("Authorization"))
            except ProxyError as exc:
                return exc.response()
        elif path == "/metrics" and not auth.may_read_metrics(request.headers.get("Authorization")):
            return error_response(401, "GET /metrics needs an API key or the metrics token as a bearer token.",
                                  code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="kvroute"'})
        return await handler(request)

    return check_client_key
