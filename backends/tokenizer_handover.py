"""The worker's side of the tokenizer hand-over: its model's tokenizer files, to each proxy it registers with.

Owns finding the files (the checkpoint folder, the engine's --tokenizer folder, or the Hugging Face cache for a
hub id), what of a vLLM command line changes how prompts are counted (--chat-template, --mm-processor-kwargs,
--default-chat-template-kwargs, --chat-template-content-format), and the exchange: the digest first, the
files only when the proxy lacks them. A failure is logged and changes nothing else: without a tokenizer the
proxy forwards every prompt and the engine answers for its length. The proxy's side: proxy/api/tokenizers.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import aiohttp

from proxy.security.redact import redact_text
from proxy.tokens.bundle import FILES, TokenizerBundle, read_model_dir

log = logging.getLogger("kvroute.tokenizer")

HANDOVER_TIMEOUT = aiohttp.ClientTimeout(total=120, connect=5)  # a 4 MiB upload over a slow link


class TokenizerHandover:
    """Hands one bundle to proxies; an instance is the reporter's `on_registered` callback."""

    def __init__(self, bundle: TokenizerBundle) -> None:
        self.bundle = bundle
        self.sha256 = bundle.sha256
        self._wire: str | None = None

    async def __call__(self, session: aiohttp.ClientSession, proxy_url: str, worker_id: str,
                       headers: dict[str, str]) -> None:
        url = f"{proxy_url}/workers/{worker_id}/tokenizer"
        try:
            have = await self._post(session, url, headers, {"sha256": self.sha256})
            if have is False:
                if self._wire is None:
                    self._wire = await asyncio.to_thread(self.bundle.to_wire)  # ~0.5 s of gzip for 11 MiB
                if await self._post(session, url, headers, {"sha256": self.sha256, "bundle": self._wire}):
                    log.info("handed tokenizer %s to %s", self.sha256[:12], redact_text(proxy_url))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.info("could not hand the tokenizer to %s (%s); it counts prompts by estimate", redact_text(proxy_url),
                     redact_text(str(exc)))

    async def _post(self, session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                    body: dict[str, str]) -> bool | None:
        """The proxy's `have`; None when it will not take a tokenizer from us."""
        async with session.post(url, data=json.dumps(body), timeout=HANDOVER_TIMEOUT,
                                headers={**headers, "Content-Type": "application/json"}) as resp:
            if resp.status == 200:
                return bool((await resp.json()).get("have"))
            if resp.status == 404:  # a proxy without the hand-over (older), or one that forgot us: no matter
                log.debug("proxy has no tokenizer hand-over (%s)", redact_text(url))
            else:
                log.warning("proxy refused the tokenizer (%s): %s", resp.status, (await resp.text())[:300])
            return None


def vllm_overrides(engine_args: list[str]) -> dict[str, object]:
    """What a vLLM command line changes in counting, as engine.json holds it."""
    out: dict[str, object] = {}
    template = _arg(engine_args, "--chat-template")
    if template is not None:
        path = Path(template).expanduser()
        if path.is_file():
            out["chat_template"] = path.read_text()
        elif "{{" in template or "{%" in template:
            out["chat_template"] = template
    for flag, key in (("--mm-processor-kwargs", "mm_processor_kwargs"),
                      ("--default-chat-template-kwargs", "default_chat_template_kwargs")):
        value = _arg(engine_args, flag)
        if value is not None:
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                out[key] = parsed
    content_format = _arg(engine_args, "--chat-template-content-format")
    if content_format in ("string", "openai"):
        out["chat_template_content_format"] = content_format
    return out


async def for_vllm(model: str, engine_args: list[str]) -> TokenizerHandover | None:
    """The hand-over for a vLLM engine serving `model` (a folder or a hub id); None without tokenizer files."""
    return await asyncio.to_thread(_for_vllm, model, engine_args)


def _for_vllm(model: str, engine_args: list[str]) -> TokenizerHandover | None:
    folders = [f for f in (_local(_arg(engine_args, "--tokenizer")), _local(model)) if f is not None]
    try:
        bundle = read_model_dir(*folders, engine=vllm_overrides(engine_args)) if folders else None
    except (OSError, ValueError) as exc:
        log.warning("tokenizer files of %s unreadable (%s); the proxy will count prompts by estimate", model, exc)
        return None
    if bundle is None:
        log.info("no tokenizer files found for %s; the proxy will count prompts by estimate", model)
        return None
    return TokenizerHandover(bundle)


def _local(name: str | None) -> Path | None:
    """A folder for a path or a hub id already in the local Hugging Face cache (nothing is downloaded)."""
    if not name:
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True, allow_patterns=list(FILES)))
    except Exception:  # not cached, not a hub id, or no huggingface_hub: no tokenizer to hand over
        return None


def _arg(args: list[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value
