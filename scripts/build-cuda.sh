#!/usr/bin/env bash
# Builds the `--features cuda` release binary on this GPU-less machine and strips it: the one
# file a device run carries (docs/cuda-build.md). nvcc and the CUDA libraries come from PyPI
# (scripts/cuda-toolchain.sh, installed into .cache/cuda on first use).
#
#   scripts/build-cuda.sh [OUTPUT]      default OUTPUT: fantom-sidecar-cuda (at the checkout root)
#
# Writes OUTPUT (stripped, ~72 MiB: 32 MiB of it is candle's sm_90 kernels) and OUTPUT.gz
# (~21 MiB, at most 40), the one to carry: benches/gpu/run.sh takes either.
# Env: CARGO_TARGET_DIR (default target-cuda, apart from the CPU build's target/),
# CUDA_COMPUTE_CAP (default 90, the H200's; PTX is JIT-compiled for the card it runs on).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTPUT=${1:-fantom-sidecar-cuda}
TOOLCHAIN=.cache/cuda
LIMIT=$((40 << 20))   # the project's bound on the carry (a device run may carry 64 MiB)

[ -f "$TOOLCHAIN/env.sh" ] || scripts/cuda-toolchain.sh "$TOOLCHAIN"
# shellcheck disable=SC1091
source "$TOOLCHAIN/env.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
started=$(date +%s)
cargo build --release --features cuda --bin fantom-sidecar
strip -o "$OUTPUT" "$CARGO_TARGET_DIR/release/fantom-sidecar"
gzip -9 -c "$OUTPUT" > "$OUTPUT.gz"
bytes=$(stat -c %s "$OUTPUT") packed=$(stat -c %s "$OUTPUT.gz")
echo "built $OUTPUT: $((bytes >> 20)) MiB stripped, $OUTPUT.gz $((packed >> 20)) MiB, in $(( $(date +%s) - started )) s"
if [ "$packed" -gt "$LIMIT" ]; then
  echo "error: $OUTPUT.gz is $((packed >> 20)) MiB, over the 40 MiB bound (a device run carries 64)" >&2
  exit 1
fi
# It starts here (and fails cleanly without a driver): the link stub stands in for libcuda.
"./$OUTPUT" --version
