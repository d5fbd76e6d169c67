#!/usr/bin/env bash
# The GPU check in one call, on the GPU machine, in about five minutes. Builds nothing: it runs a
# binary built here with `--features cuda` (scripts/build-cuda.sh) against the checkout's files.
#
#   benches/gpu/run.sh [BINARY]          default BINARY: fantom-sidecar-cuda.gz (or a plain binary)
#
#  1. kernels: every kernel of ours (packed attention, the layer ops, pooling, the gate's cosines)
#     against its CPU body on the device (`fantom-sidecar kernel-check`);
#  2. correctness: the tiny Qwen3 embedder and reranker (tests/fixtures/qwen3) on the GPU in f32
#     (padded attention), bf16 and f16 (packed), against the CPU's f32 path of the same binary,
#     on the fixture texts plus one-token and max-length rows in one batch, with and without the
#     fused pooling kernel; embeddings (and MRL at 32) min cosine >= 0.9999 in f32, >= 0.999 in
#     bf16/f16; reranker probabilities within 1e-3 / 2e-2; nothing NaN;
#  3. throughput: ours (`fantom-sidecar bench`, random weights of benches/gpu/qwen3-*.config.json)
#     against torch + transformers with SDPA attention (benches/gpu/torch_peer.py) on the same
#     shapes: Qwen3-0.6B and 4B at 1, 32 and 256 rows of 512 tokens and at 8 192-token rows, with
#     the fraction of the card's dense bf16 peak;
#  4. every pinned Qwen3 manifest (0.6B, 4B, 8B embedders and rerankers, max_tokens 8192) started
#     with its defaults on random weights of its shapes (the budget sized from free memory, the
#     full warm-up), and one request served;
#  5. serve against the one-shot embed: the same committed texts (benches/texts.jsonl), model
#     (0.6B shapes, --max-tokens 512) and device, from clients outside (benches/gpu/serve_load.py),
#     with the GPU defaults and two other pipeline settings;
#  6. where the time goes: `ncu` per-kernel times of one 32 × 512 batch (bounded launches), when
#     ncu is there and may read the counters.
# It prints the summary (benches/gpu/summarize.py: every goal beside its measurement) last and
# writes two files to $OUT: summary.txt and results.tar.gz (every output and log).
# Env: DEVICE (cuda:0), OUT (/tmp/fantom-gpu), PEAK_TFLOPS (default: from nvidia-smi's product
# name), SECONDS_PER_SIZE (2), BUDGET_S (290: later parts are skipped past it), SKIP (space-
# separated parts to skip: torch manifests serve ncu), DEVICE_CHECK_ONLY=1 (parts 1 and 2 only),
# SMOKE=1 (every part on one-layer models of the same widths and short rows: the script's own
# plumbing, e.g. `DEVICE=cpu SMOKE=1 benches/gpu/run.sh target/debug/fantom-sidecar` here).
# Needs python3; torch/transformers for the peer and ncu are used when present. Never the build
# machine's libcuda stub.

set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-fantom-sidecar-cuda.gz}
DEV=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/fantom-gpu}
SECS=${SECONDS_PER_SIZE:-2}
BUDGET=${BUDGET_S:-290}
SKIP=" ${SKIP:-} "
FX=tests/fixtures/qwen3
G=benches/gpu
START=$(date +%s)
mkdir -p "$OUT"
W=$(mktemp -d /tmp/fantom-gpu-work.XXXXXX)
: > "$W/skipped.txt"
# A gzipped binary (what scripts/build-cuda.sh writes to carry) is unpacked outside $OUT.
if [[ "$BIN" == *.gz ]]; then
  gunzip -c "$BIN" > "$W/fantom-sidecar" && chmod +x "$W/fantom-sidecar"
  BIN="$W/fantom-sidecar"
fi
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# Runs part $1 unless skipped or out of time (it needs about $2 seconds).
part() {
  if [[ "$SKIP" == *" $1 "* ]]; then echo "[$1 skipped: SKIP]"; return 1; fi
  if [ "$(left)" -lt "$2" ]; then echo "[$1 skipped: $(left) s left of the budget]"; echo "$1" >> "$W/skipped.txt"; return 1; fi
  echo "[$1: $(( $(date +%s) - START )) s in]"
}

# CUDA libraries from pip wheels, if python has them (the driver's libcuda comes from the system).
if command -v python3 >/dev/null; then
  NV=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  if [ -n "$NV" ]; then
    for d in $(find "$NV" -maxdepth 3 -type d -name lib); do LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
  fi
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 > "$W/gpu.txt" || true
peak_of() {
  case "$1" in
    *H200*NVL*) echo 835 ;;
    *H200*) echo 989 ;;            # H200 SXM
    *H100*NVL*) echo 835 ;;
    *H100*PCIe*) echo 756 ;;
    *H100*) echo 989 ;;            # H100 SXM
    *A100*) echo 312 ;;
    *) echo "" ;;
  esac
}
NAME=$(cut -d, -f1 "$W/gpu.txt" 2>/dev/null)
PEAK=${PEAK_TFLOPS:-$(peak_of "$NAME")}
[ -n "$PEAK" ] || PEAK=1
echo "card: ${NAME:-unknown}; dense bf16 peak: $PEAK TFLOP/s" > "$W/peak.txt"
cat "$W/peak.txt"
"$BIN" --version > "$W/version.txt" 2>&1

# Model folders of random weights: each config with the fixture tokenizer (ids are random; any
# tokenizer will do, and this one has the reranker's `yes` and `no`).
for size in 0.6b 4b 8b; do
  mkdir -p "$W/qwen3-$size"
  cp "$G/qwen3-$size.config.json" "$W/qwen3-$size/config.json"
  cp "$FX/tokenizer.json" "$W/qwen3-$size/tokenizer.json"
done
# The shapes each part runs: the real ones, or (SMOKE=1) short rows on one-layer models.
SHORT_SIZES=1,32,256 LONG_SIZES=1,4 LONG=8192 PEER_SHAPES=1x512,32x512,256x512,1x8192,4x8192
START_FLAGS="" SERVE_REPEAT=8 SERVE_SETTINGS=3
if [ "${SMOKE:-0}" = 1 ]; then
  for size in 0.6b 4b 8b; do
    python3 - "$W/qwen3-$size/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c.update(num_hidden_layers=1, vocab_size=2048, intermediate_size=c["hidden_size"])
json.dump(c, open(sys.argv[1], "w"))
PY
  done
  SHORT_SIZES=1,2 LONG_SIZES=1 LONG=1024 PEER_SHAPES=1x512,2x512,1x1024 START_FLAGS="--max-tokens 256" SERVE_REPEAT=1 SERVE_SETTINGS=1
fi

# 1. kernels
"$BIN" kernel-check --device "$DEV" > "$W/kernels.jsonl" 2> "$W/kernels.txt" || echo "kernel-check on $DEV failed; see kernels.txt"

# 2. correctness
python3 - "$FX" "$W" <<'PY'
import json, sys
fx, out = sys.argv[1], sys.argv[2]
long = " ".join(["fn lease(queue: &mut Queue) -> Option<Item> { queue.pop_front() }"] * 64)
mixed = ["x", long, "x", long]
e = json.load(open(f"{fx}/embedding_reference.json"))
open(f"{out}/docs.jsonl", "w").write("".join(json.dumps(t) + "\n" for t in e["documents"] + mixed))
r = json.load(open(f"{fx}/reranker_reference.json"))["cases"][0]
open(f"{out}/rerank-docs.jsonl", "w").write("".join(json.dumps(t) + "\n" for t in r["documents"] + mixed))
open(f"{out}/rerank-query.txt", "w").write(r["query"])
PY
run_embed() { "$BIN" embed --log-format json --model-dir "$FX/tiny-qwen3-embedding" --device "$1" --dtype "$2" ${DIMS:+--dimensions "$DIMS"} < "$W/docs.jsonl" > "$W/embed-$3.jsonl" 2>>"$W/log.jsonl"; }
run_rerank() { "$BIN" rerank --log-format json --model-dir "$FX/tiny-qwen3-reranker" --max-tokens 160 --device "$1" --dtype "$2" --query "$(cat "$W/rerank-query.txt")" < "$W/rerank-docs.jsonl" > "$W/rerank-$3.jsonl" 2>>"$W/log.jsonl"; }
run_embed cpu f32 cpu
DIMS=32 run_embed cpu f32 cpu-mrl
run_rerank cpu f32 cpu
for dt in f32 bf16 f16; do
  run_embed "$DEV" "$dt" "gpu-$dt" || echo "embed on $DEV ($dt) failed"
  DIMS=32 run_embed "$DEV" "$dt" "gpu-mrl-$dt" || echo "MRL embed on $DEV ($dt) failed"
  FANTOM_FUSED_POOLING=0 run_embed "$DEV" "$dt" "gpu-unfused-$dt" || echo "unfused embed on $DEV ($dt) failed"
  run_rerank "$DEV" "$dt" "gpu-$dt" || echo "rerank on $DEV ($dt) failed"
done
python3 - "$W" > "$W/correctness.txt" <<'PY'
import json, math, sys, os
out = sys.argv[1]
def lines(p): return [json.loads(l) for l in open(p)] if os.path.exists(p) and os.path.getsize(p) else []
def cos(a, b):
    d = sum(x * y for x, y in zip(a, b)); return d / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
cpu_e, cpu_r, cpu_m = lines(f"{out}/embed-cpu.jsonl"), lines(f"{out}/rerank-cpu.jsonl"), lines(f"{out}/embed-cpu-mrl.jsonl")
limits = {"f32": (0.9999, 1e-3), "bf16": (0.999, 2e-2), "f16": (0.999, 2e-2)}
def finite(rows, key): return all(math.isfinite(x) for r in rows for x in (r[key] if isinstance(r[key], list) else [r[key]]))
print(f"{'check':<30} {'value':>10} {'limit':>8}  verdict")
for dt, (min_cos, max_dp) in limits.items():
    ge, gr = lines(f"{out}/embed-gpu-{dt}.jsonl"), lines(f"{out}/rerank-gpu-{dt}.jsonl")
    gu, gm = lines(f"{out}/embed-gpu-unfused-{dt}.jsonl"), lines(f"{out}/embed-gpu-mrl-{dt}.jsonl")
    if not cpu_e or len(ge) != len(cpu_e) or len(gr) != len(cpu_r) or len(gu) != len(cpu_e) or len(gm) != len(cpu_m):
        print(f"{'GPU ' + dt:<30} {'no output':>10} {'':>8}  FAIL"); continue
    checks = [(f"embed min cosine ({dt})", min(cos(a["embedding"], b["embedding"]) for a, b in zip(ge, cpu_e)), min_cos, True),
              (f"MRL 32 min cosine ({dt})", min(cos(a["embedding"], b["embedding"]) for a, b in zip(gm, cpu_m)), min_cos, True),
              (f"unfused pooling min cos ({dt})", min(cos(a["embedding"], b["embedding"]) for a, b in zip(gu, cpu_e)), min_cos, True),
              (f"rerank max |dp| ({dt})", max(abs(a["probability"] - b["probability"]) for a, b in zip(gr, cpu_r)), max_dp, False)]
    for name, v, lim, at_least in checks:
        ok = v >= lim if at_least else v <= lim
        print(f"{name:<30} {v:>10.6f} {lim:>8}  {'ok' if ok else 'FAIL'}")
    fin = finite(ge, "embedding") and finite(gm, "embedding") and finite(gu, "embedding") and finite(gr, "probability")
    print(f"{'all finite (' + dt + ')':<30} {'yes' if fin else 'NO':>10} {'':>8}  {'ok' if fin else 'FAIL'}")
PY

if [ "${DEVICE_CHECK_ONLY:-0}" != 1 ]; then
  # 3. throughput, ours and torch's
  for size in 0.6b 4b; do
    if part "ours-$size" 40; then
      "$BIN" bench --log-format json --model-dir "$W/qwen3-$size" --random-weights --device "$DEV" \
        --batch-sizes "$SHORT_SIZES" --tokens 512 --seconds "$SECS" --peak-tflops "$PEAK" \
        --json "$W/bench-$size-512.json" > "$W/bench-$size-512.txt" 2>>"$W/log.jsonl" || echo "bench $size x 512 failed"
      "$BIN" bench --log-format json --model-dir "$W/qwen3-$size" --random-weights --device "$DEV" \
        --batch-sizes "$LONG_SIZES" --tokens "$LONG" --seconds "$SECS" --peak-tflops "$PEAK" \
        --json "$W/bench-$size-long.json" > "$W/bench-$size-long.txt" 2>>"$W/log.jsonl" || echo "bench $size x $LONG failed"
    fi
    if part torch 40; then
      timeout 120 python3 "$G/torch_peer.py" "$W/qwen3-$size/config.json" "$PEER_SHAPES" "$SECS" "$size" \
        > "$W/torch-$size.jsonl" 2>"$W/torch-$size.log" || echo "torch peer $size failed"
    fi
  done

  # 4. every pinned Qwen3 manifest starts with its defaults
  if part manifests 60; then
    for id in qwen3-embedding-0.6b qwen3-embedding-4b qwen3-embedding-8b qwen3-reranker-0.6b qwen3-reranker-4b qwen3-reranker-8b; do
      size=${id##*-}
      t0=$(date +%s.%N)
      if [[ "$id" == *reranker* ]]; then
        printf '"%s"\n' "fn lease(queue: &mut Queue)" "bananas are yellow" | timeout 90 "$BIN" rerank --log-format json \
          --model "$id" --model-dir "$W/qwen3-$size" --random-weights --device "$DEV" $START_FLAGS --query "how does a lease end" \
          > "$W/start-$id.jsonl" 2> "$W/start-$id.log"
      else
        printf '"%s"\n' "fn lease(queue: &mut Queue)" "bananas are yellow" | timeout 90 "$BIN" embed --log-format json \
          --model "$id" --model-dir "$W/qwen3-$size" --random-weights --device "$DEV" $START_FLAGS \
          > "$W/start-$id.jsonl" 2> "$W/start-$id.log"
      fi
      rc=$?
      python3 - "$id" "$rc" "$t0" "$W/start-$id.jsonl" "$W/start-$id.log" >> "$W/manifests.jsonl" <<'PY'
import json, sys, time
ident, rc, t0, out, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
row = {"id": ident, "started": False, "seconds": time.time() - t0}
answers = [l for l in open(out) if l.strip()]
for line in open(log):
    try: e = json.loads(line)
    except ValueError: continue
    f = e.get("fields", e)  # tracing's JSON: the fields flattened into the line, or under "fields"
    if f.get("message") == "model loaded":
        row.update(max_batch_tokens=f.get("max_batch_tokens"), source=f.get("max_batch_tokens_from"),
                   warmup_rows=f.get("warmup_rows"), attention=f.get("attention"))
    if e.get("level") == "ERROR" or "error" in f.get("message", ""):
        row.setdefault("error", f.get("message", line.strip()))
if rc == 0 and len(answers) == 2:
    row["started"] = True
else:
    row.setdefault("error", f"exit {rc}; " + open(log).read()[-300:])
print(json.dumps(row))
PY
    done
  fi

  # 5. serve against the one-shot embed, same texts, model and device
  if part serve 60; then
    for _ in $(seq "$SERVE_REPEAT"); do cat benches/texts.jsonl; done > "$W/serve-texts.jsonl"
    "$BIN" embed --log-format json --model qwen3-embedding-0.6b --model-dir "$W/qwen3-0.6b" --random-weights \
      --device "$DEV" --max-tokens 512 < "$W/serve-texts.jsonl" > /dev/null 2> "$W/oneshot.log"
    python3 - "$W/oneshot.log" > "$W/oneshot.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try: e = json.loads(line)
    except ValueError: continue
    f = e.get("fields", e)
    if "seconds" in f and "tokens" in f:
        print(json.dumps({"tokens": f["tokens"], "seconds": f["seconds"], "tokens_per_s": f["tokens"] / max(f["seconds"], 1e-9)}))
PY
    port=18090
    settings=("defaults" "--pipeline-depth 2 --max-items-per-work 64" "--pipeline-depth 8 --max-items-per-work 256")
    for setting in "${settings[@]:0:$SERVE_SETTINGS}"; do
      [ "$(left)" -lt 25 ] && { echo "[serve $setting skipped: out of time]"; break; }
      port=$((port + 1))
      rm -rf "$W/state"
      extra=""; [ "$setting" = defaults ] || extra="$setting"
      # shellcheck disable=SC2086
      "$BIN" serve --log-format json --model qwen3-embedding-0.6b --model-dir "$W/qwen3-0.6b" --random-weights \
        --device "$DEV" --max-tokens 512 --state-dir "$W/state" --listen "127.0.0.1:$port" $extra \
        > "$W/serve-$port.log" 2>&1 &
      pid=$!
      for clients in 8 32; do
        timeout 90 python3 "$G/serve_load.py" "http://127.0.0.1:$port" "$W/serve-texts.jsonl" 1 32 "$clients" \
          | python3 -c 'import json,sys; r=json.loads(sys.stdin.read() or "{}"); r["setting"]=sys.argv[1]; print(json.dumps(r))' "$setting" \
          >> "$W/serve.jsonl"
      done
      kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    done
  fi

  # 6. per-kernel times
  if command -v ncu >/dev/null && part ncu 60; then
    timeout 90 ncu --csv --page raw --metrics gpu__time_duration.sum --launch-count 400 -o "$W/prof" \
      "$BIN" bench --model-dir "$W/qwen3-0.6b" --random-weights --device "$DEV" --batch-sizes 32 --tokens 512 --seconds 0 \
      > "$W/ncu.log" 2>&1 \
      && ncu --import "$W/prof.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum > "$W/ncu.csv" 2>>"$W/ncu.log" \
      && python3 "$G/ncu_summary.py" "$W/ncu.csv" > "$W/ncu-summary.txt" 2>>"$W/ncu.log" \
      || echo "ncu could not profile (see ncu.log)" | tee "$W/ncu-summary.txt"
    rm -f "$W/prof.ncu-rep"   # the CSV and the summary are what come back
  fi
fi

python3 "$G/summarize.py" "$W" "$PEAK" > "$OUT/summary.txt" 2>&1
echo "total: $(( $(date +%s) - START )) s; skipped: $(tr '\n' ' ' < "$W/skipped.txt" 2>/dev/null)" >> "$OUT/summary.txt"
rm -f "$W/fantom-sidecar"
tar -czf "$OUT/results.tar.gz" -C "$(dirname "$W")" "$(basename "$W")" 2>/dev/null
cat "$OUT/summary.txt"
grep -q "FAIL\|MISSED\|DID NOT START" "$OUT/summary.txt" && exit 1
exit 0
