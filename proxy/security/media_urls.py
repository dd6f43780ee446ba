"""Which media URLs a client may make an engine fetch: public addresses only, unless the operator allows more.

An engine fetches every http(s) image, video or audio URL a chat request names, from inside the fleet's
network. Unguarded, any caller could have it read the cloud's metadata service (169.254.169.254), a worker's
own loopback services or anything on the private network, and learn from the answer's timing or error. This
module owns the verdict on one request's media URLs: `data:` always passes (nothing is fetched); http(s) passes
when every address its host resolves to is public (`is_global`) or inside `proxy.media_urls.allowed_networks`;
`file:` only with `allow_file_urls` (the engine must also be given `--allowed-local-media-path`); any other
scheme is refused. Resolutions are cached briefly in a bounded map. It sends nothing to the URLs.

What it cannot see: the engine resolves the name again when it fetches (a name that answers differently the
second time), and follows redirects (vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS, which workers launched by kvroute
turn off: backends/engines/vllm.py). docs/security.md says what each closes.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from yarl import URL

from proxy.errors import ProxyError
from proxy.media_config import MediaUrlPolicy
from proxy.security.networks import IPNetwork, address_of, parse_networks, resolve

# distinct hosts one request may name (each is one resolution); more is refused, not resolved
MAX_HOSTS_PER_REQUEST = 16
_CACHE_SIZE = 1024
_CACHE_TTL_S = 30.0


def media_urls(payload: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(param, url) for each media part of a chat request that names a URL (a string with a scheme)."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                continue
            part_type = part.get("type", "text")
            if not isinstance(part_type, str) or part_type == "text":
                continue
            value = part.get(part_type)
            if isinstance(value, dict):
                value = value.get("url")
            if isinstance(value, str) and ":" in value[:16]:
                yield f"messages[{i}].content[{j}]", value


def _refused(param: str, message: str) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", code="media_url_refused", param=param)


class MediaUrlGuard:
    """Checks a request's media URLs against a policy; one per proxy (its resolution cache is shared)."""

    def __init__(self) -> None:
        self._parsed: tuple[MediaUrlPolicy | None, tuple[IPNetwork, ...]] = (None, ())
        self._resolved: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()

    async def check(self, payload: dict[str, Any], policy: MediaUrlPolicy) -> None:
        """Raise a 400 `media_url_refused` ProxyError for the first URL `policy` refuses."""
        hosts: dict[str, str] = {}  # host -> the param of its first use
        for param, url in media_urls(payload):
            scheme = url.split(":", 1)[0].lower()
            if scheme == "data":
                continue
            if scheme == "file":
                if not policy.allow_file_urls:
                    raise _refused(param, "Media `file:` URLs are not accepted here (the proxy's "
                                          "`proxy.media_urls.allow_file_urls` is off).")
                continue
            if scheme not in ("http", "https"):
                raise _refused(param, f"Media URLs must be http(s) or data: URLs, not `{scheme}:`.")
            try:
                host = URL(url).host or ""
            except ValueError:
                host = ""
            if not host:
                raise _refused(param, "The media URL has no host.")
            hosts.setdefault(host.lower(), param)
            if len(hosts) > MAX_HOSTS_PER_REQUEST:
                raise _refused(param, f"A request may name media on at most {MAX_HOSTS_PER_REQUEST} hosts.")
        if hosts:
            networks = self._networks(policy)
            verdicts = await asyncio.gather(*(self._host_refusal(h, p, networks) for h, p in hosts.items()))
            for refusal in verdicts:
                if refusal is not None:
                    raise refusal

    async def _host_refusal(self, host: str, param: str, networks: tuple[IPNetwork, ...]) -> ProxyError | None:
        addresses = await self._resolve(host)
        if not addresses:
            return _refused(param, f"The media URL's host `{host}` does not resolve.")
        for text in addresses:
            addr = address_of(text)
            if addr is None:
                return _refused(param, f"The media URL's host `{host}` resolves to an unusable address.")
            if addr.is_global and not addr.is_multicast:
                continue
            if any(addr.version == net.version and addr in net for net in networks):
                continue
            return _refused(param, f"The media URL's host `{host}` is not on the public internet ({addr}); "
                                   "the proxy's `proxy.media_urls.allowed_networks` lists the other networks "
                                   "engines may fetch media from.")
        return None

    def _networks(self, policy: MediaUrlPolicy) -> tuple[IPNetwork, ...]:
        if self._parsed[0] is not policy:
            self._parsed = (policy, parse_networks(policy.allowed_networks))
        return self._parsed[1]

    async def _resolve(self, host: str) -> list[str]:
        now = time.monotonic()
        cached = self._resolved.get(host)
        if cached is not None and cached[0] > now:
            self._resolved.move_to_end(host)
            return cached[1]
        try:
            addresses = await resolve(host)
        except (OSError, TimeoutError, UnicodeError):
            addresses = []  # remembered too: a name that does not resolve costs one lookup per TTL
        self._resolved[host] = (now + _CACHE_TTL_S, addresses)
        self._resolved.move_to_end(host)
        while len(self._resolved) > _CACHE_SIZE:
            self._resolved.popitem(last=False)
        return addresses
