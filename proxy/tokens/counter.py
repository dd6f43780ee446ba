"""One served model's tokenizer: a request's prompt counted as the engine counts it, with a per-message cache.

Owns the `tokenizers` tokenizer built from a bundle, the rendered prompt's split at the tokenizer's added tokens
(`<|im_start|>`, `<|image_pad|>`, ...), the cache of each piece between them (in a chat template that is one
message, so a conversation costs only its new turn), and the expansion of each media placeholder to the tokens
its image becomes. Counting runs in three steps so the slow one can leave the event loop: `prepare` (render,
split, look up; no cache writes), `encode` (the uncached pieces; thread-safe, `tokenizers` releases the GIL),
`finish` (assemble, remember; on the thread that owns the counter). `count` does all three.

Splitting at added tokens is exact: the tokenizer itself cuts its input there before anything else, as long as
no added token strips its neighbours or is matched after normalisation; a tokenizer with such tokens is encoded
whole (still exact, without the cache).
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from proxy.tokens.bundle import TOKENIZER_JSON, TokenizerBundle
from proxy.tokens.conversation import MediaRef, Unsupported, conversation, tools_for_template
from proxy.tokens.media import image_size_from_data_url
from proxy.tokens.prompt import CountedPrompt, MediaItem
from proxy.tokens.template import TemplateSet, TemplateUnavailable, special_tokens, tokenizer_template
from proxy.tokens.vision import vision_rules

# Characters of pieces each model's cache keeps (the text and its ids: ~2 bytes a character, so ~16 MiB):
# a few hundred long system prompts and conversation histories.
CACHE_CHARS = 8 * 1024 * 1024
# A rendered prompt longer than this is left to the engine (which refuses text over max_model_len x its longest
# token before tokenizing): the proxy's work per request stays bounded (~1-2 s of a thread).
MAX_TEXT_CHARS = 4 * 1024 * 1024
# What the engine renders differently from what this module models: the count is then left to the engine.
_UNMODELLED_FIELDS = ("chat_template", "truncate_prompt_tokens", "mm_processor_kwargs", "prompt_embeds")
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"


class Uncountable(ValueError):
    """This request's prompt cannot be counted exactly here (the engine will count it)."""


@dataclass
class Pending:
    """A rendered prompt split into pieces: cached ids, (token id, 1) for an added token, a str to encode,
    or a MediaRef for a media placeholder."""

    pieces: list[Any]
    missing: list[str] = field(default_factory=list)
    add_special: bool = False  # encode the one text with the tokenizer's special tokens (not cached)
    text_chars: int = 0  # the rendered prompt's length

    @property
    def missing_chars(self) -> int:
        return sum(map(len, self.missing))


class PromptCounter:
    """Counts prompts for one tokenizer bundle. Not thread-safe except `encode` (see the module docstring)."""

    def __init__(self, bundle: TokenizerBundle, cache_chars: int = CACHE_CHARS) -> None:
        self.sha256 = bundle.sha256
        self.tokenizer = Tokenizer.from_str(bundle.text(TOKENIZER_JSON) or "")
        self.tokenizer.no_truncation()  # a tokenizer.json may carry settings that would cut the count short
        self.tokenizer.no_padding()
        tok_config = bundle.json("tokenizer_config.json") or {}
        engine = bundle.json("engine.json") or {}
        processor_template = (bundle.json("chat_template.json") or {}).get("chat_template")
        jinja_file = bundle.text("chat_template.jinja")
        self.templates = TemplateSet(engine.get("chat_template") if isinstance(engine.get("chat_template"), str)
                                     else None,
                                     processor_template if isinstance(processor_template, str) else jinja_file,
                                     tokenizer_template(tok_config, jinja_file),
                                     engine.get("chat_template_content_format"))
        self.special = {**special_tokens(bundle.json("special_tokens_map.json")), **special_tokens(tok_config)}
        defaults = engine.get("default_chat_template_kwargs")
        self.default_template_kwargs = defaults if isinstance(defaults, dict) else {}
        self.vision = vision_rules(bundle.json("preprocessor_config.json"), bundle.json("processor_config.json"),
                                   bundle.json("config.json"), engine)
        added = self.tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        self._pad_ids = {"image": self._added_ids.get(IMAGE_PAD), "video": self._added_ids.get(VIDEO_PAD)}
        # cutting at added tokens is the tokenizer's own first step only for plain (unstripped, raw-matched) ones
        self._segmentable = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        contents = sorted(self._added_ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._adds_special = self.tokenizer.num_special_tokens_to_add(False) > 0
        self.max_chars_per_token = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=0)
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cache_chars = 0
        self._cache_limit = cache_chars

    # --- the three steps ----------------------------------------------------------------------
    def prepare(self, payload: dict[str, Any], chat: bool) -> Pending:
        """Render and split the prompt of `payload`; Uncountable where the engine would count differently."""
        if any(payload.get(key) is not None for key in _UNMODELLED_FIELDS):
            raise Uncountable("a request field the proxy does not model")
        if chat:
            text, media, add_special = self._render_chat(payload)
        else:
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                try:
                    return Pending([array("q", prompt)])  # the client's ids, as they are
                except OverflowError:
                    raise Uncountable("token ids out of range") from None
            if not isinstance(prompt, str):
                raise Uncountable("a batch of prompts")
            text, media, add_special = prompt, [], payload.get("add_special_tokens", True) is not False
        if len(text) > MAX_TEXT_CHARS:
            raise Uncountable(f"a prompt of {len(text)} characters")
        add_special = add_special and self._adds_special
        if add_special or not self._segmentable or self._split is None:
            if media:
                raise Uncountable("media in a prompt this tokenizer must encode whole")
            pending = Pending([text], [text], add_special=add_special)
        else:
            pending = self._pieces(text, media)
        pending.text_chars = len(text)
        return pending

    def encode(self, pending: Pending) -> list[array]:
        """Token ids of each of `pending`'s missing texts. Safe on any thread."""
        if not pending.missing:
            return []
        encodings = self.tokenizer.encode_batch_fast(pending.missing, add_special_tokens=pending.add_special)
        return [array("I", e.ids) for e in encodings]  # 4 bytes an id: the cache holds ids of millions of characters

    def finish(self, pending: Pending, encoded: list[array]) -> CountedPrompt:
        """The counted prompt, from `prepare`'s pieces and `encode`'s ids for its missing texts."""
        fresh = dict(zip(pending.missing, encoded, strict=True))
        pieces: list[array | tuple[int, int]] = []
        media: list[MediaItem] = []
        total = 0
        for piece in pending.pieces:
            if isinstance(piece, str):
                ids = fresh.get(piece)
                if ids is None:
                    ids = self._cached(piece)
                elif not pending.add_special:
                    self._remember(piece, ids)
                if ids is None:  # evicted between prepare and finish
                    ids = self.encode(Pending([], [piece]))[0]
                piece = ids
            elif isinstance(piece, MediaRef):
                length = self._media_tokens(piece)
                media.append(MediaItem(piece.kind, piece.url or "", total, length))
                piece = (self._pad_ids[piece.kind], length)
            pieces.append(piece)
            total += piece[1] if isinstance(piece, tuple) else len(piece)
        return CountedPrompt(pieces, total, media, pending.text_chars, self.max_chars_per_token)

    def count(self, payload: dict[str, Any], chat: bool) -> CountedPrompt:
        pending = self.prepare(payload, chat)
        return self.finish(pending, self.encode(pending))

    # --- chat ---------------------------------------------------------------------------------
    def _render_chat(self, payload: dict[str, Any]) -> tuple[str, list[MediaRef], bool]:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Uncountable("no messages")
        try:
            tools = tools_for_template(payload.get("tools"))
            template = self.templates.select(tools is not None)
            convo, media = conversation(messages, template.content_format, template.has_developer_role)
            add_generation_prompt = payload.get("add_generation_prompt", True) is not False
            continue_final = payload.get("continue_final_message") is True
            if add_generation_prompt and continue_final:
                raise Uncountable("add_generation_prompt and continue_final_message together")
            variables = dict(self.special)
            accepted = template.variables
            user = payload.get("chat_template_kwargs") or {}
            if not isinstance(user, dict) or "chat_template" in user or "tokenize" in user:
                raise Uncountable("chat_template_kwargs the engine refuses")
            for given in (self.default_template_kwargs, user):
                variables.update((k, v) for k, v in given.items() if k in accepted)
            effort = payload.get("reasoning_effort")
            if effort is not None:
                variables["reasoning_effort"] = effort
                if "enable_thinking" not in user:
                    variables["enable_thinking"] = effort != "none"
            variables.update(tools=tools, documents=payload.get("documents"),
                             add_generation_prompt=add_generation_prompt)
            text = template.render(convo, variables, continue_final)
        except (Unsupported, TemplateUnavailable) as exc:
            raise Uncountable(str(exc)) from None
        return text, media, payload.get("add_special_tokens") is True

    # --- pieces and media ---------------------------------------------------------------------
    def _pieces(self, text: str, media: list[MediaRef]) -> Pending:
        pending = Pending([])
        missing: set[str] = set()
        waiting = list(reversed(media))
        for i, piece in enumerate(self._split.split(text)):  # type: ignore[union-attr]
            if i % 2:  # an added token
                kind = "image" if piece == IMAGE_PAD else "video" if piece == VIDEO_PAD else None
                if kind is not None:
                    if not waiting or waiting[-1].kind != kind:
                        raise Uncountable("the template's media placeholders do not match the request's media")
                    pending.pieces.append(waiting.pop())
                else:
                    pending.pieces.append((self._added_ids[piece], 1))
            elif piece:
                if piece not in missing and self._cache.get(piece) is None:
                    missing.add(piece)
                    pending.missing.append(piece)
                pending.pieces.append(piece)
        if waiting:
            raise Uncountable("media the template did not place")
        return pending

    def _media_tokens(self, ref: MediaRef) -> int:
        if ref.kind != "image" or self._pad_ids["image"] is None:
            raise Uncountable("video (its frames are not read here)")
        size = image_size_from_data_url(ref.url) if ref.url and ref.url.startswith("data:") else None
        if size is None:
            raise Uncountable("an image whose size the proxy cannot read (an http URL or an unknown format)")
        tokens = self.vision.image_tokens(*size)
        if tokens is None:
            raise Uncountable("an image the processor refuses")
        return tokens

    # --- the cache ----------------------------------------------------------------------------
    def _cached(self, text: str) -> array | None:
        ids = self._cache.get(text)
        if ids is not None:
            self._cache.move_to_end(text)
        return ids

    def _remember(self, text: str, ids: array) -> None:
        if len(text) > self._cache_limit // 4 or text in self._cache:
            return
        self._cache[text] = ids
        self._cache_chars += len(text)
        while self._cache_chars > self._cache_limit:
            old, _ = self._cache.popitem(last=False)
            self._cache_chars -= len(old)
