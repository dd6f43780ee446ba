#!/usr/bin/env bash
# GPU smoke test: one kvroute proxy, one vLLM worker and one LMDeploy worker on ONE NVIDIA GPU,
# serving a randomly initialised checkpoint with Qwen3-VL-2B's real dimensions; then text and
# image requests through the proxy and straight to each engine, with the results printed.
# Then disaggregated prefill/decode over NIXL: those workers stop, a prefill and a decode vLLM worker
# (`kvroute worker --role prefill|decode --kv-transfer ...`) start on the same GPU, and a text and an
# image prompt sent to the prefill worker (one token, do_remote_decode) and then, with the
# kv_transfer_params it answered, to the decode worker must give the prefill worker's own greedy tokens,
# directly and through the proxy's own P/D path (x-kvroute-worker naming both workers).
#
# Usage:  deploy/gpu-smoke.sh [GPU_ID]            (default GPU 0)
# Env:    KVROUTE_PY      python of a venv with kvroute + GPU vllm   (default .venv/bin/python)
#         LMDEPLOY_BIN    folder holding the `lmdeploy` CLI, usually its own venv's bin, since
#                         LMDeploy pins its own torch (default .venv-lmdeploy/bin; skipped if absent)
#         SMOKE_DIR       where the checkpoint and logs go          (default .run/gpu-smoke)
#         VLLM_MEM_FRAC   vLLM's --gpu-memory-utilization           (default 0.40)
#         LMDEPLOY_CACHE  LMDeploy's --cache-max-entry-count         (default 0.30 of what is free then)
#         SMOKE_PD        1 (default): run the P/D step, which needs `nixl` in KVROUTE_PY's venv
#                         (pip install nixl); 0: skip it
#         PD_MEM_FRAC     --gpu-memory-utilization of each P/D worker  (default 0.35)
# Exit status: 0 when every request succeeded, 1 otherwise. Every process started is stopped on exit.
set -euo pipefail

GPU="${1:-0}"
cd "$(dirname "$0")/.."
PY="${KVROUTE_PY:-.venv/bin/python}"
LMDEPLOY_BIN="${LMDEPLOY_BIN:-.venv-lmdeploy/bin}"
SMOKE_DIR="${SMOKE_DIR:-.run/gpu-smoke}"
MODEL_DIR="$SMOKE_DIR/qwen3-vl-2b-random"
SERVED=qwen3-vl-2b
mkdir -p "$SMOKE_DIR"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PROXY_PORT="$(free_port)"; VLLM_PORT="$(free_port)"; LMD_PORT="$(free_port)"
PROXY="http://127.0.0.1:$PROXY_PORT"
PIDS=()
# The engines' own key (a worker otherwise gives its engine a random one only the proxy knows): this script
# calls the engines directly too.
ENGINE_KEY="${ENGINE_KEY:-smoke-$RANDOM$RANDOM}"

cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
  done
}
trap cleanup EXIT INT TERM

log() { printf '[gpu-smoke %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# wait_ready WORKER_ID TIMEOUT_S PID: until GET /workers lists the worker as ready (or its process died)
wait_ready() {
  local id="$1" timeout="$2" pid="$3" start=$SECONDS
  while (( SECONDS - start < timeout )); do
    if ! kill -0 "$pid" 2>/dev/null; then log "$id exited; last log lines:"; tail -n 40 "$SMOKE_DIR/$id.log"; return 1; fi
    if curl -fsS "$PROXY/workers" 2>/dev/null | "$PY" -c '
import json, sys
workers = {w["worker_id"]: w for w in json.load(sys.stdin)["workers"]}
sys.exit(0 if workers.get(sys.argv[1], {}).get("state") == "ready" else 1)' "$id"; then
      log "$id ready after $(( SECONDS - start )) s"; return 0
    fi
    sleep 2
  done
  log "$id not ready after ${timeout} s"; tail -n 40 "$SMOKE_DIR/$id.log"; return 1
}

log "GPU $GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i "$GPU" 2>/dev/null || echo 'nvidia-smi not found')"
if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  log "building the qwen3-vl-2b-shaped checkpoint in $MODEL_DIR (needs ~10 GB RAM, a few minutes)"
  "$PY" -m proxy.cli make-tiny-model "$MODEL_DIR" --shape qwen3-vl-2b
fi

log "proxy on :$PROXY_PORT"
# every request of the P/D step's model is split (the default, conditional, keeps light load whole)
echo "proxy: {routing: {disagg: {split: always}}}" >"$SMOKE_DIR/proxy.yaml"
"$PY" -m proxy.cli proxy --port "$PROXY_PORT" --config "$SMOKE_DIR/proxy.yaml" >"$SMOKE_DIR/proxy.log" 2>&1 &
PIDS+=("$!")
for _ in $(seq 1 60); do curl -fsS "$PROXY/health" >/dev/null 2>&1 && break; sleep 0.5; done

log "vLLM worker on GPU $GPU, port $VLLM_PORT"
KVROUTE_LOG_DIR="$SMOKE_DIR" VLLM_API_KEY="$ENGINE_KEY" "$PY" -m proxy.cli worker --engine vllm --model "$MODEL_DIR" --gpus "$GPU" \
  --served-model-name "$SERVED" --port "$VLLM_PORT" --worker-id vllm-0 --proxy-url "$PROXY" \
  -- --gpu-memory-utilization "${VLLM_MEM_FRAC:-0.40}" --max-model-len 8192 >"$SMOKE_DIR/vllm-0.log" 2>&1 &
PIDS+=("$!")
wait_ready vllm-0 900 "${PIDS[-1]}"

ENGINE_URLS=("http://127.0.0.1:$VLLM_PORT")
if [[ -x "$LMDEPLOY_BIN/lmdeploy" ]]; then
  log "LMDeploy worker (--engine turbomind) on GPU $GPU, port $LMD_PORT"
  PATH="$LMDEPLOY_BIN:$PATH" KVROUTE_LOG_DIR="$SMOKE_DIR" "$PY" -m proxy.cli worker --engine turbomind \
    --model "$MODEL_DIR" --gpus "$GPU" --served-model-name "$SERVED" --port "$LMD_PORT" --worker-id lmdeploy-0 \
    --proxy-url "$PROXY" -- --cache-max-entry-count "${LMDEPLOY_CACHE:-0.30}" --session-len 8192 --api-keys "$ENGINE_KEY" \
    >"$SMOKE_DIR/lmdeploy-0.log" 2>&1 &
  PIDS+=("$!")
  wait_ready lmdeploy-0 900 "${PIDS[-1]}"
  ENGINE_URLS+=("http://127.0.0.1:$LMD_PORT")
else
  log "no $LMDEPLOY_BIN/lmdeploy: skipping the LMDeploy worker (set LMDEPLOY_BIN)"
fi

log "fleet as the proxy sees it:"
curl -fsS "$PROXY/workers" | "$PY" -c '
import json, sys
for w in json.load(sys.stdin)["workers"]:
    r = w.get("last_report") or {}
    print("  %-12s engine=%-9s state=%-8s kv_capacity_tokens=%s kv_usage=%s" % (
        w["worker_id"], w["engine"], w["state"], w["kv_capacity_tokens"], r.get("kv_cache_usage")))'

log "requests (through the proxy, then straight to each engine):"
status=0
ENGINE_KEY="$ENGINE_KEY" "$PY" - "$PROXY" "$SERVED" "${ENGINE_URLS[@]}" <<'PYEOF' || status=$?
import base64, json, os, struct, sys, time, zlib
import httpx

proxy, model, engines = sys.argv[1], sys.argv[2], sys.argv[3:]
engine_auth = {"Authorization": f"Bearer {os.environ['ENGINE_KEY']}"}

def png(width, height, rgb):
    """A solid-colour PNG without Pillow."""
    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    body = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw))
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + body + chunk(b"IEND", b"")).decode()

image = {"type": "image_url", "image_url": {"url": png(448, 336, (200, 40, 40))}}
other = {"type": "image_url", "image_url": {"url": png(224, 224, (20, 90, 200))}}
cases = [
    ("text", "Describe a harbour at dawn."),
    ("1 image", [image, {"type": "text", "text": "What is in this picture?"}]),
    ("2 images", [image, other, {"type": "text", "text": "How do these differ?"}]),
]
failures = 0
with httpx.Client(timeout=300) as http:
    for base in [proxy, *engines]:
        for name, content in cases:
            body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 32}
            t0 = time.perf_counter()
            try:
                resp = http.post(f"{base}/v1/chat/completions", json=body, headers={} if base == proxy else engine_auth)
                ok = resp.status_code == 200 and "choices" in resp.json()
            except httpx.HTTPError as exc:
                resp, ok = None, False
                print(f"  {base:28} {name:9} ERROR {exc}")
            if resp is not None:
                usage = resp.json().get("usage", {}) if ok else {}
                print(f"  {base:28} {name:9} HTTP {resp.status_code} {1000 * (time.perf_counter() - t0):7.0f} ms "
                      f"worker={resp.headers.get('x-kvroute-worker', '-'):11} prompt_tokens={usage.get('prompt_tokens')} "
                      f"completion_tokens={usage.get('completion_tokens')}" + ("" if ok else f" body={resp.text[:300]}"))
            failures += not ok
    # A streamed answer through the proxy, with usage in the last chunk.
    chunks, usage = 0, None
    with http.stream("POST", f"{proxy}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 32,
            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                chunks += 1
                usage = chunk.get("usage") or usage
    print(f"  stream through proxy: HTTP {resp.status_code}, {chunks} chunks, usage={usage}")
    failures += resp.status_code != 200 or usage is None
print(f"  {failures} failed request(s)")
sys.exit(1 if failures else 0)
PYEOF

if [[ "${SMOKE_PD:-1}" == "1" ]]; then
  log "P/D over NIXL: stopping the workers above, then a prefill and a decode vLLM worker on GPU $GPU"
  for pid in "${PIDS[@]:1}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:1}"; do
    for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  done
  if ! "$PY" -c 'import nixl' 2>/dev/null; then
    log "nixl is not installed in $PY's venv: pip install nixl (its wheels bundle UCX), or SMOKE_PD=0"; exit 1
  fi
  pd_worker() {  # pd_worker ROLE KV_ROLE PORT
    KVROUTE_LOG_DIR="$SMOKE_DIR" VLLM_API_KEY="$ENGINE_KEY" "$PY" -m proxy.cli worker --engine vllm \
      --model "$MODEL_DIR" --gpus "$GPU" --served-model-name "$SERVED" --port "$3" --worker-id "pd-$1-0" \
      --proxy-url "$PROXY" --role "$1" \
      --kv-transfer "{\"connector\": \"NixlConnector\", \"kv_role\": \"$2\", \"extra\": {}, \"options\": {}}" \
      -- --gpu-memory-utilization "${PD_MEM_FRAC:-0.35}" --max-model-len 8192 >"$SMOKE_DIR/pd-$1-0.log" 2>&1 &
    PIDS+=("$!")
  }
  P_PORT="$(free_port)"; D_PORT="$(free_port)"
  pd_worker prefill kv_producer "$P_PORT"
  wait_ready pd-prefill-0 900 "${PIDS[-1]}"
  pd_worker decode kv_consumer "$D_PORT"
  wait_ready pd-decode-0 900 "${PIDS[-1]}"
  ENGINE_KEY="$ENGINE_KEY" "$PY" - "$PROXY" "$SERVED" "http://127.0.0.1:$P_PORT" "http://127.0.0.1:$D_PORT" \
    <<'PYEOF' || status=1
import base64, json, os, struct, sys, zlib
import httpx

proxy, model, prefill, decode = sys.argv[1:5]
auth = {"Authorization": f"Bearer {os.environ['ENGINE_KEY']}"}

def png(width, height, rgb):
    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    body = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw))
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + body + chunk(b"IEND", b"")).decode()

roles = {w["worker_id"]: w.get("role") for w in httpx.get(f"{proxy}/workers", timeout=10).json()["workers"]}
print(f"  roles: {roles}")
failures = int(roles.get("pd-prefill-0") != "prefill" or roles.get("pd-decode-0") != "decode")
cases = [("text", "Describe a harbour at dawn, the boats and the gulls. " * 40),
         ("image", [{"type": "image_url", "image_url": {"url": png(448, 336, (200, 40, 40))}},
                    {"type": "text", "text": "What is in this picture? Describe it in detail."}])]
with httpx.Client(timeout=300, headers=auth) as http:
    def ask(url, content, max_tokens, **extra):
        body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": False, **extra}
        resp = http.post(f"{url}/v1/chat/completions", json=body)
        resp.raise_for_status()
        return resp.json()
    for name, content in cases:
        aggregated = ask(prefill, content, 32)
        first = ask(prefill, content, 1, kv_transfer_params={"do_remote_decode": True})
        params = first.get("kv_transfer_params") or {}
        answer = ask(decode, content, 32, kv_transfer_params=params)
        same = answer["choices"][0]["token_ids"] == aggregated["choices"][0]["token_ids"]
        print(f"  P/D {name:5} prompt_tokens={aggregated['usage']['prompt_tokens']} "
              f"blocks={sum(len(g) for g in params.get('remote_block_ids') or [])} "
              f"remote={params.get('remote_host')}:{params.get('remote_port')} equal_to_aggregated={same}")
        failures += not same or not params.get("remote_block_ids")
        # the same through kvroute's own P/D path: prefill leg, KV over NIXL, decode leg relayed
        via = http.post(f"{proxy}/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        routed = via.status_code == 200 and via.json()["choices"][0]["token_ids"] == aggregated["choices"][0]["token_ids"]
        print(f"  P/D {name:5} through kvroute: HTTP {via.status_code}, x-kvroute-worker="
              f"{via.headers.get('x-kvroute-worker')}, equal_to_aggregated={routed}")
        failures += not routed or via.headers.get("x-kvroute-worker") != "pd-prefill-0,pd-decode-0"
    metrics = http.get(f"{decode}/metrics").text
    print("  decode side: " + "; ".join(line for line in metrics.splitlines()
                                        if line.startswith(("vllm:nixl_xfer_time_seconds_count",
                                                            "vllm:nixl_num_failed_transfers"))))
print(f"  {failures} P/D failure(s)")
sys.exit(1 if failures else 0)
PYEOF
fi
log "logs: $SMOKE_DIR (engine logs: kvroute-engine-*.log)"
exit "$status"
