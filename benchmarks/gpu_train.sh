#!/usr/bin/env bash
# A short training run at the suite's own shapes on every local GPU: ResNet-34 at 224 px on a folder
# of JPEGs cut from the shipped photos (7 classes, 500×375 px), read through the input pipeline,
# the data-parallel step on every local device, then the input pipeline alone. Records the step's
# and the whole loop's images per second, per device and in total (metrics.jsonl), and top-1/top-5.
#
# Usage:  benchmarks/gpu_train.sh [OUT_DIR]       (default benchmarks/results/train_gpu; about 5 minutes
#                                                 on one H100, ResNet-34's compiles included)
# Needs JAX's CUDA build (.venv/bin/pip install -U "jax[cuda12]") and the pinned grain and
# orbax-checkpoint (requirements.txt); WHEELS=DIR installs those two from a folder of wheels first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-benchmarks/results/train_gpu}
WORK=${WORK:-$(mktemp -d)}
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" grain==0.2.18 orbax-checkpoint==0.12.8
fi
"$PY" - <<'PYEOF'
import sys, jax
if jax.default_backend() != "gpu":
    sys.exit(f"benchmarks/gpu_train.sh: JAX sees no GPU (backend {jax.default_backend()!r})")
print(f"{jax.local_device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
PYEOF
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/gradtie-jax}
mkdir -p "$OUT"
"$PY" -m gradtie.folder "$WORK/photos" --per-class 192 --val-per-class 32
# two epochs of the recipe's step on every local device: batch 64 a device, heavy ball, lr 0.1
# with one warmup epoch, label smoothing 0.1, random resized crops and flips at 224 px
"$PY" -m gradtie train --net resnet34 --data "folder:$WORK/photos" --image-size 224 --batch 64 \
  --optimizer heavy-ball --lr 0.1 --warmup-epochs 1 --label-smoothing 0.1 --epochs 2 --precise-batches 4 \
  --workers "$(( $(nproc) - 2 ))" --out "$WORK/run" | tee "$OUT/train.log"
cp "$WORK/run/run.json" "$WORK/run/metrics.jsonl" "$OUT/"
"$PY" -m gradtie bench --input --data "folder:$WORK/photos" --workers 1 2 4 8 --out "$OUT/input.json" | tee "$OUT/input.log"
