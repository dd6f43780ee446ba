"""Connecting to Redis as configured: the URL, and beside it a password, an ACL user and TLS options.

Owns building a client from `state` (proxy/config.py's StateConfig); not what is kept there
(proxy/workers/redis_mirror.py, the rate limiter in clientauth.py) nor how secrets kept there are sealed (statecrypt.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

if TYPE_CHECKING:
    from proxy.config import StateConfig


def redis_client(state: StateConfig, *, connect_timeout_s: float, timeout_s: float) -> aioredis.Redis:
    """A client for `state.url` with `state.password` / `username` and `state.tls`; nothing connects yet.

    `tls` on a redis:// URL turns TLS on (the URL becomes rediss://); a password in the config wins over
    one in the URL, so the URL may be logged and kept in plain sight."""
    url = state.url
    options: dict[str, Any] = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": timeout_s}
    if state.password is not None:
        options["password"] = state.password
    if state.username is not None:
        options["username"] = state.username
    if state.tls is not None:
        if url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]
        options.update(ssl_cert_reqs="required", ssl_check_hostname=state.tls.check_hostname)
        if state.tls.ca_file:
            options["ssl_ca_certs"] = state.tls.ca_file
        if state.tls.cert_file:
            options["ssl_certfile"] = state.tls.cert_file
        if state.tls.key_file:
            options["ssl_keyfile"] = state.tls.key_file
    return aioredis.from_url(url, **options)
