#!/usr/bin/env bash
# The GPU check in one call, on the GPU machine. Builds nothing: it runs a binary built here with
# `--features cuda` (docs/cuda-build.md) against the checkout's fixtures.
#
#   benches/gpu/run.sh [BINARY]          default BINARY: target/release/fantom-sidecar (or BINARY.gz)
#
# 1. kernels: our CUDA kernels (kernels/*.cu: fused pooling + normalisation, the gate's cosine
#    matrix) against their CPU bodies (`fantom-sidecar kernel-check`);
# 2. correctness: the tiny Qwen3 embedder and reranker (tests/fixtures/qwen3) on the GPU in f32,
#    bf16 and f16, against the CPU's f32 path of the same binary (the checks the CPU runs in CI
#    through the GPU's code path: tests/local_inference/half.rs), on the fixture texts plus
#    max-length and one-token rows in one batch, with candle's pooling and with our fused
#    kernel (FANTOM_FUSED_POOLING=1): embeddings (and MRL) min cosine >= 0.9999 in f32, >= 0.999
#    in bf16/f16; reranker probabilities within 1e-3 in f32, 2e-2 in bf16/f16; nothing NaN;
# 3. throughput: the Qwen3-4B architecture with random weights (same FLOPs as the real model) at
#    batch sizes 1, 32, 256 × 512 tokens, tokens/s and the fraction of the card's dense bf16
#    peak, with candle's pooling and with the fused kernel.
# Full numbers go to $OUT (default /tmp/fantom-gpu); a short table is printed last.
# Env: DEVICE (cuda:0), OUT, PEAK_TFLOPS (default: from nvidia-smi's product name, e.g. 989 for an
# H200 SXM, 835 for an H200 NVL), SECONDS_PER_SIZE (5), DEVICE_CHECK_ONLY=1 to skip the
# throughput part. Needs python3 (for the comparison only) and the CUDA 13 libraries (pip
# `nvidia-*` wheels or /usr/local/nvidia); never the build machine's libcuda stub. Takes about
# two minutes on an H200 (under 8: the device call's budget).

set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${1:-target/release/fantom-sidecar}
DEV=${DEVICE:-cuda:0}
OUT=${OUT:-/tmp/fantom-gpu}
SECS=${SECONDS_PER_SIZE:-5}
FX=tests/fixtures/qwen3
mkdir -p "$OUT"
# A gzipped binary (what scripts/build-cuda.sh writes to carry) is unpacked first.
if [[ "$BIN" == *.gz ]]; then
  gunzip -c "$BIN" > "$OUT/fantom-sidecar" && chmod +x "$OUT/fantom-sidecar"
  BIN="$OUT/fantom-sidecar"
fi

# CUDA libraries from pip wheels, if python has them (the driver's libcuda comes from the system).
if command -v python3 >/dev/null; then
  NV=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  if [ -n "$NV" ]; then
    for d in $(find "$NV" -maxdepth 3 -type d -name lib); do LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
  fi
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/nvidia/lib64:/usr/local/nvidia/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt" || true
# The card's dense (not sparse) bf16 peak, from its product name, unless PEAK_TFLOPS says.
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
NAME=$(head -1 "$OUT/gpu.txt" 2>/dev/null | cut -d, -f1)
PEAK=${PEAK_TFLOPS:-$(peak_of "$NAME")}
if [ -z "$PEAK" ]; then
  echo "no known bf16 peak for '${NAME:-no GPU name}': set PEAK_TFLOPS; using 1 (fractions are then TFLOP/s)"
  PEAK=1
fi
echo "card: ${NAME:-unknown}; dense bf16 peak: $PEAK TFLOP/s" | tee "$OUT/peak.txt"

python3 - "$FX" "$OUT" <<'PY'
import json, sys
fx, out = sys.argv[1], sys.argv[2]
# One-token rows between rows longer than the models take (cut to exactly their max length).
long = " ".join(["fn lease(queue: &mut Queue) -> Option<Item> { queue.pop_front() }"] * 64)
mixed = ["x", long, "x", long]
e = json.load(open(f"{fx}/embedding_reference.json"))
open(f"{out}/docs.jsonl", "w").write("".join(json.dumps(t) + "\n" for t in e["documents"] + mixed))
r = json.load(open(f"{fx}/reranker_reference.json"))["cases"][0]
open(f"{out}/rerank-docs.jsonl", "w").write("".join(json.dumps(t) + "\n" for t in r["documents"] + mixed))
open(f"{out}/rerank-query.txt", "w").write(r["query"])
PY

run_embed() { "$BIN" embed --log-format json --model-dir "$FX/tiny-qwen3-embedding" --device "$1" --dtype "$2" ${DIMS:+--dimensions "$DIMS"} < "$OUT/docs.jsonl" > "$OUT/embed-$3.jsonl" 2>>"$OUT/log.jsonl"; }
run_rerank() { "$BIN" rerank --log-format json --model-dir "$FX/tiny-qwen3-reranker" --max-tokens 160 --device "$1" --dtype "$2" --query "$(cat "$OUT/rerank-query.txt")" < "$OUT/rerank-docs.jsonl" > "$OUT/rerank-$3.jsonl" 2>>"$OUT/log.jsonl"; }
status=0
"$BIN" kernel-check --device "$DEV" > "$OUT/kernels.jsonl" 2> "$OUT/kernels.txt" || { echo "kernel-check on $DEV failed; see $OUT/kernels.txt"; status=1; }
run_embed cpu f32 cpu
DIMS=32 run_embed cpu f32 cpu-mrl
run_rerank cpu f32 cpu
for dt in f32 bf16 f16; do
  run_embed "$DEV" "$dt" "gpu-$dt" || { echo "embed on $DEV ($dt) failed; see $OUT/log.jsonl"; status=1; }
  DIMS=32 run_embed "$DEV" "$dt" "gpu-mrl-$dt" || { echo "MRL embed on $DEV ($dt) failed; see $OUT/log.jsonl"; status=1; }
  FANTOM_FUSED_POOLING=1 run_embed "$DEV" "$dt" "gpu-fused-$dt" || { echo "fused embed on $DEV ($dt) failed; see $OUT/log.jsonl"; status=1; }
  run_rerank "$DEV" "$dt" "gpu-$dt" || { echo "rerank on $DEV ($dt) failed; see $OUT/log.jsonl"; status=1; }
done

python3 - "$OUT" <<'PY' | tee "$OUT/correctness.txt"
import json, math, sys, os
out = sys.argv[1]
def lines(p): return [json.loads(l) for l in open(p)] if os.path.exists(p) and os.path.getsize(p) else []
def cos(a, b):
    d = sum(x * y for x, y in zip(a, b)); return d / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
cpu_e, cpu_r = lines(f"{out}/embed-cpu.jsonl"), lines(f"{out}/rerank-cpu.jsonl")
cpu_m = lines(f"{out}/embed-cpu-mrl.jsonl")
limits = {"f32": (0.9999, 1e-3), "bf16": (0.999, 2e-2), "f16": (0.999, 2e-2)}
def finite(rows, key): return all(math.isfinite(x) for r in rows for x in (r[key] if isinstance(r[key], list) else [r[key]]))
ok = True
print(f"{'check':<28} {'value':>12} {'limit':>10}  verdict")
for dt, (min_cos, max_dp) in limits.items():
    ge, gr = lines(f"{out}/embed-gpu-{dt}.jsonl"), lines(f"{out}/rerank-gpu-{dt}.jsonl")
    if len(ge) != len(cpu_e) or len(gr) != len(cpu_r):
        print(f"{'GPU ' + dt:<28} {'no output':>12} {'':>10}  FAIL"); ok = False; continue
    gf, gm = lines(f"{out}/embed-gpu-fused-{dt}.jsonl"), lines(f"{out}/embed-gpu-mrl-{dt}.jsonl")
    if len(gf) != len(cpu_e) or len(gm) != len(cpu_m):
        print(f"{'fused/MRL ' + dt:<28} {'no output':>12} {'':>10}  FAIL"); ok = False; continue
    c = min(cos(a["embedding"], b["embedding"]) for a, b in zip(ge, cpu_e))
    cm = min(cos(a["embedding"], b["embedding"]) for a, b in zip(gm, cpu_m))
    cf = min(cos(a["embedding"], b["embedding"]) for a, b in zip(gf, cpu_e))
    p = max(abs(a["probability"] - b["probability"]) for a, b in zip(gr, cpu_r))
    fin = finite(ge, "embedding") and finite(gm, "embedding") and finite(gf, "embedding") and finite(gr, "probability")
    for name, v, lim, good in [(f"embed min cosine ({dt})", c, min_cos, c >= min_cos),
                               (f"MRL embed min cos ({dt})", cm, min_cos, cm >= min_cos),
                               (f"fused embed min cos ({dt})", cf, min_cos, cf >= min_cos),
                               (f"rerank max |dp| ({dt})", p, max_dp, p <= max_dp),
                               (f"all finite ({dt})", float(fin), 1, fin)]:
        print(f"{name:<28} {v:>12.6f} {lim:>10}  {'ok' if good else 'FAIL'}"); ok &= good
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ "${DEVICE_CHECK_ONLY:-0}" != 1 ]; then
  CFG="$OUT/qwen3-4b"
  mkdir -p "$CFG"
  cp benches/gpu/qwen3-4b.config.json "$CFG/config.json"
  cp "$FX/tokenizer.json" "$CFG/tokenizer.json"   # ids are random; any tokenizer will do
  "$BIN" bench --log-format json --model-dir "$CFG" --random-weights --device "$DEV" \
    --batch-sizes 1,32,256 --tokens 512 --seconds "$SECS" --peak-tflops "$PEAK" \
    --json "$OUT/throughput.json" > "$OUT/throughput.txt" 2>>"$OUT/log.jsonl" || { echo "throughput run failed; see $OUT/log.jsonl"; status=1; }
  FANTOM_FUSED_POOLING=1 "$BIN" bench --log-format json --model-dir "$CFG" --random-weights --device "$DEV" \
    --batch-sizes 1,32,256 --tokens 512 --seconds "$SECS" --peak-tflops "$PEAK" \
    --json "$OUT/throughput-fused.json" > "$OUT/throughput-fused.txt" 2>>"$OUT/log.jsonl" || { echo "fused throughput run failed; see $OUT/log.jsonl"; status=1; }
fi

echo
echo "== GPU check ($DEV) =="
tail -1 "$OUT/kernels.txt"
cat "$OUT/correctness.txt"
[ -f "$OUT/throughput.txt" ] && { echo "-- candle pooling"; cat "$OUT/throughput.txt"; }
[ -f "$OUT/throughput-fused.txt" ] && { echo "-- fused pooling kernel"; cat "$OUT/throughput-fused.txt"; }
echo "full results: $OUT"
exit $status
