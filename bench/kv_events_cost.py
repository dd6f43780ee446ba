"""What the engines' KV events cost the proxy: a report carrying a batch, and naming a prompt's blocks.

Owns this one measurement, the figures behind docs/design/kv-events.md. In process, best of --repeats:
- the report fast path (proxy/dataplane/reports.py answer_report: parse, validate, record, apply the batch)
  for a report without a batch, with a delta of N stored and N removed blocks, and with a snapshot; the
  difference is what riding in the report adds, to compare with the whole cost of a report of its own
  (bench/results/*-report-cost-fast-path.md: ~128 us of proxy CPU each, end to end);
- hashing a prompt's blocks as vLLM does (block_hash.py) and matching them (engine_blocks.py), for short and
  long prompts at vLLM's GPU and CPU block sizes, cold (new tokens) and warm (a prefix seen before).
Run: `python -m bench.kv_events_cost` (~20 s).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

from bench.report import environment_note, md_table, results_path, write_json
from proxy.dataplane.reports import answer_report
from proxy.kvevents import KvEventBatch, pack_hashes
from proxy.protocol import LoadReport, WorkerRegistration
from proxy.routing import block_hash
from proxy.routing.block_hash import HashScheme, block_hashes
from proxy.routing.engine_blocks import EngineBlocks
from proxy.security.controlauth import secret_hash
from proxy.workers.registry import Registry

SECRET = "s" * 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default="kv-events-cost")


def best_us(fn: Callable[[], object], repeats: int, loops: int) -> float:
    """Best mean over `repeats` runs of `loops` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        best = min(best, (time.perf_counter() - t0) / loops)
    return best * 1e6


class ReportBench:
    """One registered worker whose reports go through the fast path into an EngineBlocks."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.blocks = EngineBlocks()
        self.registry.add_listener(self.blocks.on_registry_event)
        self.registry.register(WorkerRegistration(worker_id="w", url="http://w:1", models=["m"], boot_id="b"),
                               secret_hash=secret_hash(SECRET))
        self.seq = 0
        self.batch_seq = 0
        self.rng = random.Random(1)
        self.auth = f"Bearer {SECRET}".encode()

    def body(self, batch: KvEventBatch | None) -> bytes:
        self.seq += 1
        report = LoadReport(worker_id="w", url="http://w:1", models=["m"], engine="vllm", kv_cache_usage=0.3,
                            kv_capacity_tokens=16 * 40_000, num_running=3, num_waiting=0, seq=self.seq,
                            boot_id="b", kv_events=batch)
        return report.model_dump_json(exclude_none=True).encode()

    def answer(self, body: bytes) -> None:
        assert answer_report(self.registry, "w", self.auth, body, True) is not None

    def snapshot(self, blocks: int) -> bytes:
        self.batch_seq += 1
        hashes = [self.rng.getrandbits(64) for _ in range(blocks)]
        return self.body(KvEventBatch(seq=self.batch_seq, snapshot=True, stored=pack_hashes(hashes), block_size=16,
                                      hash_algo="sha256_cbor", hash_seed="vllm-none-hash", capacity_blocks=40_000))

    def delta_us(self, n: int, repeats: int, loops: int = 200) -> tuple[float, int]:
        """us per report carrying a delta of n stored and n removed blocks (the cache stays at its size)."""
        held = list(self.blocks.view("w").blocks)
        bodies = []
        for _ in range(loops * repeats):
            self.batch_seq += 1
            new = [self.rng.getrandbits(64) for _ in range(n)]
            gone, held = held[:n], held[n:] + new
            bodies.append(self.body(KvEventBatch(seq=self.batch_seq, stored=pack_hashes(new),
                                                 removed=pack_hashes(gone))))
        size = len(bodies[0])
        it = iter(bodies)
        return best_us(lambda: self.answer(next(it)), repeats, loops), size


def run(args: argparse.Namespace) -> int:
    bench = ReportBench()
    rows: list[list[object]] = []
    data: dict[str, object] = {}
    plain = [bench.body(None) for _ in range(2000 * args.repeats)]
    it = iter(plain)
    base = best_us(lambda: bench.answer(next(it)), args.repeats, 2000)
    rows.append(["no batch", len(plain[0]), f"{base:.1f}", "-"])
    bench.answer(bench.snapshot(20_000))
    for n in (8, 64, 512):
        us, size = bench.delta_us(n, args.repeats)
        rows.append([f"delta: {n} stored + {n} removed", size, f"{us:.1f}", f"{us - base:+.1f}"])
        data[f"delta_{n}_us"] = us
    snaps = [bench.snapshot(20_000) for _ in range(args.repeats * 3)]
    it = iter(snaps)
    snap_us = best_us(lambda: bench.answer(next(it)), args.repeats, 3)
    rows.append(["snapshot: 20000 new blocks", len(snaps[0]), f"{snap_us:.0f}", f"{snap_us - base:+.0f}"])
    held = list(bench.blocks.view("w").blocks)
    again = []
    for _ in range(args.repeats * 3):  # the periodic snapshot of a cache the view already follows
        bench.batch_seq += 1
        again.append(bench.body(KvEventBatch(seq=bench.batch_seq, snapshot=True, stored=pack_hashes(held),
                                             block_size=16, hash_algo="sha256_cbor", hash_seed="vllm-none-hash",
                                             capacity_blocks=40_000)))
    it = iter(again)
    same_us = best_us(lambda: bench.answer(next(it)), args.repeats, 3)
    rows.append(["snapshot: the same 20000 blocks", len(again[0]), f"{same_us:.0f}", f"{same_us - base:+.0f}"])
    data.update(no_batch_us=base, snapshot_20k_us=snap_us, snapshot_same_20k_us=same_us)

    hash_rows: list[list[object]] = []
    rng = random.Random(2)
    index = EngineBlocks()
    for tokens in (1000, 10_000):
        for size in (16, 128):
            scheme = HashScheme(size)
            warm_ids = [rng.randrange(150_000) for _ in range(tokens)]
            block_hashes(scheme, warm_ids)
            cold = [[rng.randrange(150_000) for _ in range(tokens)] for _ in range(args.repeats * 5)]
            prompts = iter(cold)
            cold_us = best_us(lambda s=scheme, p=prompts: block_hashes(s, next(p)), args.repeats, 5)
            warm_us = best_us(lambda s=scheme, ids=warm_ids: block_hashes(s, ids), args.repeats, 5)
            hashes = block_hashes(scheme, warm_ids)
            match_us = best_us(lambda h=hashes: index.match(h), args.repeats, 50)
            hash_rows.append([tokens, size, len(hashes), f"{cold_us:.0f}", f"{warm_us:.0f}", f"{match_us:.1f}"])
            data[f"hash_{tokens}_{size}"] = {"cold_us": cold_us, "warm_us": warm_us, "match_us": match_us}
            block_hash._hash_block.cache_clear()
    # match against a fleet: 64 workers, each holding a shared 2000-token system prompt and its own sessions
    scheme = HashScheme(16)
    shared = [rng.randrange(150_000) for _ in range(2000)]
    fleet = ReportBench()
    for w in range(64):
        wid = f"w{w}"
        fleet.registry.register(WorkerRegistration(worker_id=wid, url=f"http://{wid}:1", models=["m"], boot_id="b"))
        own = block_hashes(scheme, shared + [rng.randrange(150_000) for _ in range(8000)])
        fleet.registry.record_report(wid, LoadReport(
            worker_id=wid, url=f"http://{wid}:1", models=["m"], kv_cache_usage=0.3, kv_capacity_tokens=16 * 40_000,
            num_running=0, num_waiting=0, seq=1, boot_id="b", kv_events=KvEventBatch(
                seq=1, snapshot=True, stored=pack_hashes(own), block_size=16, hash_algo="sha256_cbor",
                hash_seed="vllm-none-hash")))
    request = block_hashes(scheme, shared + [rng.randrange(150_000) for _ in range(2000)])
    fleet_match_us = best_us(lambda: fleet.blocks.match(request), args.repeats, 50)
    data["fleet_match_us"] = fleet_match_us

    lines = ["# The engines' KV events: what they cost the proxy", "",
             f"{environment_note()}. Command: `python -m bench.kv_events_cost {' '.join(sys.argv[1:])}`", "",
             "## A load report carrying a KV-event batch (the fast path, in process)", "",
             f"Best of {args.repeats}; one worker whose view holds 20000 blocks. `added` is what the batch adds to "
             "the report; a separate POST per batch would instead cost a whole report of its own (~128 us of "
             "proxy CPU on the fast path, bench/results/2026-12-02-report-cost-fast-path.md) plus this parsing.", "",
             md_table(["report", "body bytes", "us per report", "added"], rows), "",
             "## Naming a prompt's blocks as vLLM does, and matching them", "",
             "block_hash.block_hashes (sha256_cbor) per prompt: cold = tokens never seen, warm = the same prompt "
             "again (its blocks are in the memo); match = engine_blocks.match on an empty index.", "",
             md_table(["prompt tokens", "block size", "blocks", "cold us", "warm us", "match us"], hash_rows), "",
             f"Match of a 4000-token prompt (125 blocks of 16, its first 125 shared) over 64 workers that each hold "
             f"the shared 2000-token prefix and 8000 tokens of their own: {fleet_match_us:.0f} us.", ""]
    text = "\n".join(lines)
    results_path(args.name, ".md").write_text(text)
    write_json(results_path(args.name, ".json"), {"reports": rows, "hashing": hash_rows, **data})
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
