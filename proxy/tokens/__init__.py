"""Exact prompt tokens: a request's prompt counted as its engine counts it, with the served model's own tokenizer.

Owns the tokenizer bundles workers hand over (bundle.py), the chat path vLLM takes (conversation.py, template.py),
Qwen3-VL's image token rule (vision.py, media.py), counting with a per-message cache (counter.py), one tokenizer
per served model and when a request is counted (store.py), and the context-length rule (limits.py). Routing and
admission read the results from RoutedRequest; nothing here routes.

For code that needs the ids (the KV-event block hashes): `RoutedRequest.tokens` is a `prompt.PromptTokens`, or
None when the model's workers gave the proxy no tokenizer.

- `routed.tokens.counted` -> `prompt.CountedPrompt | None`: None where the proxy cannot know the engine's count
  (an http(s) image, video, audio, a field such as `truncate_prompt_tokens`); computed on first use when routing
  did not need it (a short prompt: well under a millisecond), else already there (`routed.tokens.ready`).
- `CountedPrompt.token_ids`: every prompt token id as vLLM's engine receives it, each image's single
  `<|image_pad|>` expanded to its placeholder tokens; `num_tokens` (== `len(token_ids)`).
- `CountedPrompt.media`: `prompt.MediaItem`s in prompt order: `kind` ("image"), `offset` and `length` (its
  placeholder span in token_ids), `content_hash` (sha256 hex of its data: URL, or of its http URL: what the
  proxy may give vLLM as the item's `uuid`).
- `routed.token_ids`: shorthand for `routed.tokens.counted.token_ids` (None where unknown).
- `routed.exact_tokens`: True when prompt_tokens/media_tokens are the engine's own count (counted before routing).
"""
