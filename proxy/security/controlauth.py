"""Who may use the control plane (/workers*, /nodes/*, /fleet*): admin, worker token, worker secret, network.

Owns reading a caller's credentials (Bearer, or Basic as LMDeploy sends from `--proxy-url
http://user:TOKEN@host`), the closed-by-default rule (administering always takes the admin token, on
loopback too; a proxy started without one makes one), per-worker secrets, and the start-up refusal
of an open control plane off loopback. Which route needs what is control.py's; the caller's address
is peer.py's; what a browser may not send is browser.py's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from proxy.protocol import WORKER_SECRET_HEADER
from proxy.security.networks import address_in, parse_networks
from proxy.security.peer import client_host, is_loopback, is_loopback_bind

ADMIN_TOKEN_ENV = "KVROUTE_ADMIN_TOKEN"
WORKER_TOKEN_ENV = "KVROUTE_WORKER_TOKEN"
INSECURE_FLAG = "--insecure-open-control-plane"
ADMIN_WHAT = "the control plane"


class _Tokens(Protocol):
    admin_token: str | None
    worker_token: str | None
    trusted_worker_networks: list[str]
    insecure_open_control_plane: bool


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def secret_hash(secret: str | bytes) -> str:
    """What the registry keeps of a worker secret (never the secret itself)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw).hexdigest()


def token_or_none(value: str | None) -> str | None:
    """An empty or blank token is no token: `admin_token: ${KVROUTE_ADMIN_TOKEN:-}` with the variable unset."""
    return value if value is not None and value.strip() else None


def _raw(text: str) -> bytes | None:
    """Header text back to its bytes. aiohttp decodes headers with surrogateescape, so invalid UTF-8
    arrives as lone surrogates; they must give a wrong token, never an exception (a 500)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def presented_token(authorization: str | None) -> bytes | None:
    """The credential in an Authorization header: `Bearer T`, or `Basic base64(user:T)` (T = the password,
    or the user name when there is no password). None when absent or malformed."""
    if not authorization:
        return None
    raw = _raw(authorization.strip())
    if raw is None:
        return None
    scheme, _, value = raw.partition(b" ")
    value = value.strip()
    if scheme.lower() == b"bearer":
        return value or None
    if scheme.lower() == b"basic":
        try:
            user, _, password = base64.b64decode(value, validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return None
        return password or user or None
    return None


def _same(given: bytes | None, expected: str | None) -> bool:
    return given is not None and expected is not None and hmac.compare_digest(given, expected.encode())


@dataclass(frozen=True, slots=True)
class Caller:
    """One control-plane request's credentials, resolved once by the middleware."""

    host: str
    loopback: bool
    admin: bool               # the admin token (or --insecure-open-control-plane)
    worker_token: bool        # the configured worker token
    trusted_network: bool     # from proxy.trusted_worker_networks
    anonymous_register: bool  # loopback while no worker token is configured
    secrets: tuple[bytes, ...]  # tokens that may be a worker's own secret
    digests: tuple[str, ...] = ()  # their secret_hash values, computed once

    @property
    def may_register(self) -> bool:
        return self.admin or self.worker_token or self.trusted_network or self.anonymous_register

    @property
    def has_credential(self) -> bool:
        return bool(self.secrets)

    def owns(self, worker_secret_hash: str | None) -> bool:
        """Whether this caller presented the secret of the worker whose hash is given."""
        if not worker_secret_hash:
            return False
        return any(hmac.compare_digest(d, worker_secret_hash) for d in self.digests)


class ControlAuth:
    """The control plane's credentials, from the proxy config (tokens fixed at start-up)."""

    def __init__(self, config: _Tokens) -> None:
        self.admin_token = token_or_none(config.admin_token)
        self.worker_token = token_or_none(config.worker_token)
        self.trusted = parse_networks(config.trusted_worker_networks)
        self.open = bool(config.insecure_open_control_plane)

    def caller(self, request: web.Request) -> Caller:
        host = client_host(request)
        loopback = is_loopback(host)
        token = presented_token(request.headers.get("Authorization"))
        extra = request.headers.get(WORKER_SECRET_HEADER)
        extra_raw = _raw(extra.strip()) if extra else None
        admin = _same(token, self.admin_token) or (self.admin_token is None and self.open)
        return Caller(host=host, loopback=loopback, admin=admin, worker_token=_same(token, self.worker_token),
                      trusted_network=bool(self.trusted) and address_in(host, self.trusted),
                      anonymous_register=self.worker_token is None and (loopback or self.open),
                      secrets=(given := tuple(s for s in (token, extra_raw) if s)),
                      digests=tuple(secret_hash(s) for s in given))

    def denied(self, caller: Caller, what: str, worker_secret_hashes: Iterable[str | None] = ()) -> web.Response:
        """401 without a usable credential, 403 with one that does not reach `what` (the worker token, a
        trusted network, or the secret of some worker among `worker_secret_hashes`)."""
        from proxy.errors import error_response

        if what == ADMIN_WHAT and self.admin_token is None and not self.open:
            return error_response(403, f"{what} needs the admin token, and this proxy has none (set "
                                       f"proxy.admin_token or {ADMIN_TOKEN_ENV}).", "permission_error",
                                  code="control_plane_closed")
        closed = self.admin_token is None and not caller.loopback and not self.open
        if closed and not caller.has_credential:
            return error_response(403, f"{what} answers only callers on this machine while no admin token is "
                                       "configured (proxy.admin_token).", "permission_error",
                                  code="control_plane_closed")
        known = caller.has_credential and (self._known(caller) or bool(set(caller.digests) & set(worker_secret_hashes)))
        if caller.worker_token or caller.trusted_network or known:
            return error_response(403, f"This credential does not allow {what}.", "permission_error",
                                  code="forbidden")
        needed = "the admin token as a bearer token" if what == ADMIN_WHAT else "a valid bearer token"
        return error_response(401, f"{what} needs {needed}.", "authentication_error",
                              code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="kvroute"'})

    def _known(self, caller: Caller) -> bool:
        return any(_same(s, t) for s in caller.secrets for t in (self.admin_token, self.worker_token))


def startup_problem(host: str, admin_token: str | None, insecure: bool) -> tuple[bool, str | None]:
    """(may start, message to print). Off loopback without an admin token the control plane would be
    open to the network: refuse, unless the operator insists, and then warn loudly on every start."""
    if token_or_none(admin_token) is not None or is_loopback_bind(host):
        return True, None
    if insecure:
        bar = "!" * 78
        return True, (f"{bar}\nWARNING: {INSECURE_FLAG}: the control plane on {host} is OPEN to anyone who can "
                      "reach it.\nAnyone can register workers (and receive prompts), drain or remove them, and "
                      "under\n`kvroute up` start processes on this host. Set proxy.admin_token instead.\n{bar}")
    return False, (f"refusing to listen on {host} with an open control plane: set proxy.admin_token "
                   f"(or {ADMIN_TOKEN_ENV}), bind 127.0.0.1, or pass {INSECURE_FLAG}")
