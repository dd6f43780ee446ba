"""Mooncake-format traces as bench families: reading, windows, rate, and token-exact block text."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from backends.sim.kvcache import block_hashes
from backends.sim.tokens import text_token_ids
from bench.quality import select_families
from bench.traces import (
    BLOCK_TOKENS,
    TRACE_URL,
    BlockVocabulary,
    TraceRequest,
    family_for_path,
    file_sha256,
    load_window,
    read_trace,
    render_prompt,
    synthetic_trace,
)

REPO = Path(__file__).resolve().parents[2]
TINY_TRACE = REPO / "bench" / "data" / "tiny_trace.jsonl"
TINY_MODEL = REPO / "models" / "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def tiny_vocab() -> BlockVocabulary:
    assert (TINY_MODEL / "tokenizer.json").exists(), "run `make setup` (it builds models/tiny-qwen3-vl)"
    return BlockVocabulary(TINY_MODEL)


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_committed_tiny_trace_is_the_seeded_generator_output():
    assert TINY_TRACE.read_text() == "".join(json.dumps(r) + "\n" for r in synthetic_trace(7, 80))


def test_a_trace_is_read_in_arrival_order_and_a_bad_line_is_named(tmp_path):
    rows = [{"timestamp": 2500, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
            {"timestamp": 1000, "input_length": 512, "output_length": 7, "hash_ids": [0]}]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert trace == [TraceRequest(1.0, 512, 7, (0,)), TraceRequest(2.5, 600, 3, (0, 1))]
    with pytest.raises(ValueError, match=r"t\.jsonl:2: 1 hash ids for 513 input tokens"):
        read_trace(write_trace(tmp_path / "t.jsonl", [rows[0], {**rows[1], "input_length": 513}]))
    with pytest.raises(ValueError, match=r"t\.jsonl:1: not a Mooncake trace line"):
        read_trace(write_trace(tmp_path / "t.jsonl", [{"timestamp": 0}]))


@pytest.mark.parametrize("vocab_of", ["sim", "tiny model"])
def test_every_prompt_has_exactly_its_input_length_in_tokens_block_by_block(vocab_of, tiny_vocab):
    vocab = tiny_vocab if vocab_of == "tiny model" else BlockVocabulary()
    tokenizers = [lambda text: text_token_ids(text)]
    if vocab_of == "tiny model":  # the same text is exact for the real tokenizer too
        tokenizers.append(lambda text: tiny_vocab.tokenizer.encode(text).ids)  # as vLLM encodes a prompt
    block = "".join(vocab.block(42, "salt"))
    for count in tokenizers:
        assert len(count(block)) == BLOCK_TOKENS
        assert len(count(block * 3)) == 3 * BLOCK_TOKENS  # blocks do not merge at their borders
    cache: dict[int, list[str]] = {}
    for req in read_trace(TINY_TRACE)[:25]:
        prompt = render_prompt(req, vocab, "salt", cache)
        for count in tokenizers:
            assert len(count(prompt)) == req.input_length


def test_requests_sharing_hash_ids_share_exactly_those_blocks(tiny_vocab):
    shared = TraceRequest(0.0, 2 * BLOCK_TOKENS + 100, 1, (7, 8, 9))
    other = TraceRequest(0.0, 3 * BLOCK_TOKENS, 1, (7, 8, 10))
    cut = TraceRequest(0.0, BLOCK_TOKENS + 40, 1, (7, 8))  # block 8 in part: its first 40 tokens
    cache: dict[int, list[str]] = {}
    ids = [text_token_ids(render_prompt(r, tiny_vocab, "s", cache)) for r in (shared, other, cut)]
    assert ids[0][:2 * BLOCK_TOKENS] == ids[1][:2 * BLOCK_TOKENS]
    assert ids[0][2 * BLOCK_TOKENS:2 * BLOCK_TOKENS + 16] != ids[1][2 * BLOCK_TOKENS:2 * BLOCK_TOKENS + 16]
    assert ids[2] == ids[0][:BLOCK_TOKENS + 40]
    # the engine sees the same: equal block hashes over the shared blocks, different after them (16-token blocks)
    hashes = [block_hashes(t, 16, len(t) // 16) for t in ids[:2]]
    assert hashes[0][:64] == hashes[1][:64] and hashes[0][64] != hashes[1][64]
    # another cell (salt) renders every block anew, with the same structure
    again = [text_token_ids(render_prompt(r, tiny_vocab, "t", {})) for r in (shared, other)]
    assert again[0][:16] != ids[0][:16] and again[0][:2 * BLOCK_TOKENS] == again[1][:2 * BLOCK_TOKENS]


def test_a_window_keeps_its_arrival_times_scaled_by_the_speedup(tmp_path):
    rows = [{"timestamp": t, "input_length": 700, "output_length": 9, "hash_ids": [0, 1 + i]}
            for i, t in enumerate((500, 1000, 4000, 7000, 9000, 12000))]
    rows[3] |= {"input_length": 5000, "hash_ids": list(range(100, 110))}  # too long for an 4096-token engine
    path = write_trace(tmp_path / "demo_trace.jsonl", rows)
    w = load_window("trace_demo", path, start_s=1.0, duration_s=10.0, max_context=4096, kv_tokens=8192,
                    model="m", vocab=BlockVocabulary())
    assert [r.t_s for r in w.requests] == [1.0, 4.0, 9.0] and w.skipped_over_context == 1
    assert w.native_rate == pytest.approx(3 / 10.0)
    assert w.meta() == {"trace": "demo_trace.jsonl", "trace_sha256": file_sha256(path), "trace_start_s": 1.0,
                        "trace_duration_s": 10.0, "trace_requests": 3, "trace_rate": pytest.approx(0.3),
                        "trace_skipped_over_context": 1}
    for speedup in (1.0, 2.5):
        specs = w.specs(w.native_rate * speedup, salt="x")
        assert [s.arrival_s for s in specs] == pytest.approx([0.0, 3.0 / speedup, 8.0 / speedup])
    body = specs[0].body
    assert specs[0].path == "/v1/completions" and body["stream"] and body["ignore_eos"]
    assert body["max_tokens"] == body["min_tokens"] == 9 and len(text_token_ids(body["prompt"])) == 700
    assert w.shared_prefix_key(0) == 0 and w.shared_prefix_tokens() == BLOCK_TOKENS  # block 0, in every request


def test_trace_families_come_from_their_files_and_a_missing_one_says_how_to_get_it(tmp_path):
    def args(**kw) -> argparse.Namespace:
        return argparse.Namespace(**{"families": None, "trace": [], "trace_dir": tmp_path, **kw})

    assert family_for_path(Path("x/conversation_trace.jsonl")) == "trace_conversation"
    families, files = select_families(args(trace=[TINY_TRACE]))
    assert families == ["trace_tiny"] and files == {"trace_tiny": TINY_TRACE}
    families, files = select_families(args())  # no trace file in the folder: the six generated families
    assert "trace_conversation" not in families and len(families) == 6 and not files
    families, files = select_families(args(families="kv_pressure,trace_synthetic"))
    assert families == ["kv_pressure", "trace_synthetic"]
    with pytest.raises(FileNotFoundError, match=TRACE_URL + "synthetic_trace.jsonl"):
        load_window("trace_synthetic", files["trace_synthetic"], 0.0, 300.0, 32768, 65536, "m", BlockVocabulary())
    with pytest.raises(SystemExit, match="unknown family 'trace_nope'"):
        select_families(args(families="trace_nope"))


def test_a_trace_windows_floor_prices_only_blocks_no_earlier_request_of_the_window_presented(tmp_path):
    from backends.sim.presets import get_preset
    from bench.ttft_floor import compare_traces, request_floor_s, trace_floors

    preset = get_preset("h100-qwen3-vl-8b")
    rows = [{"timestamp": 1000, "input_length": 2048, "output_length": 8, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 2000, "input_length": 2100, "output_length": 8, "hash_ids": [1, 2, 3, 4, 5]},  # 52 new
            {"timestamp": 3000, "input_length": 1024, "output_length": 8, "hash_ids": [9, 2]},  # 2 after a miss
            {"timestamp": 4000, "input_length": 32000, "output_length": 8000, "hash_ids": list(range(20, 83))},
            {"timestamp": 9000, "input_length": 512, "output_length": 8, "hash_ids": [1]}]  # after the window
    write_trace(tmp_path / "conversation_trace.jsonl", rows)
    floors = trace_floors("trace_conversation", preset, 1.0, 5.0, tmp_path)
    # the fourth request does not fit the context (it would be refused, and the bench leaves it out)
    assert len(floors) == 3
    assert floors[0] == request_floor_s(preset, [0] * 2048, [], 0)
    assert floors[1] == request_floor_s(preset, [0] * 2100, [], 2048) < floors[0] / 5
    assert floors[2] == request_floor_s(preset, [0] * 1024, [], 0)
    # the first window second only
    assert trace_floors("trace_conversation", preset, 1.0, 1.0, tmp_path) == floors[:1]
    result = {"rows": [{"family": "trace_conversation", "load": 0.5, "route": route, "ttft_p90": p90, "ttft_p99": p99}
                       for route, p90, p99 in (("kvroute:default", 0.05, 0.09), ("vllm-router:kv_aware", 0.06, 0.1),
                                               ("oracle", 0.001, 0.001))]}
    table = compare_traces(result, {"trace_conversation": floors})
    assert len(table) == 4 and table[2].startswith("| trace_conversation | 0.5 | p90 |")
    # 0.8 x the best peer (the oracle is none) against the floor's percentile: the largest floor here is 72 ms
    assert table[2].endswith(" | 60 | 48 | 50 | no: below the floor |")
    assert table[3].endswith(" | 100 | 80 | 90 | yes |")
