#!/usr/bin/env bash
# The GPU run, in one command: ResNet-34 at 224 px, batch 64 and 256, f32 and bf16 conv sites, the
# rendered step against the autodiff step, R = every local device. It reports images/s, the ratio
# rendered/autodiff, XLA's compiled memory, the device's peak memory and the model FLOP utilisation
# against the device's dense peak, and writes benchmarks/results/gpu.json (rewritten after every
# configuration, so a run cut short keeps what it measured), then the peers (benchmarks/results/peers_gpu.json).
#
# Installs nothing beyond the README's GPU step:  .venv/bin/pip install -U "jax[cuda12]"
# Usage:  benchmarks/gpu.sh [OUT.json]        (about 4 minutes on one H100/H200, compiles included)
#
# Before spending device time, validate the shapes and memory on a CPU (no GPU needed):
#         .venv/bin/gradtie bench --abstract --profile gpu --chapters benchmark
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-benchmarks/results/gpu.json}
"$PY" - <<'PYEOF'
import sys, jax
if jax.default_backend() != "gpu":
    sys.exit(f"benchmarks/gpu.sh: JAX sees no GPU (backend {jax.default_backend()!r}); install the CUDA "
             "build first: .venv/bin/pip install -U 'jax[cuda12]' (README, 'On a GPU')")
print(f"{jax.local_device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
PYEOF
# The compiles, not the steps, are what takes the time: all eight programs are compiled at once into
# JAX's persistent cache, then each configuration runs in a fresh process (its own peak memory)
# that loads them. A second run reuses the cache.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/gradtie-jax}
"$PY" -m gradtie bench --suite gpu --warm-cache --out "$OUT"
echo "wrote $OUT"
# The peers on the same device: autodiff, plain JAX (NCHW, NHWC) and, where PyTorch is installed
# (requirements-peers.txt; its CUDA build uses the GPU), PyTorch eager, each in its own process,
# checked against the oracle first. Without PyTorch its column says "not run".
PEERS_OUT=${PEERS_OUT:-benchmarks/results/peers_gpu.json}
"$PY" -m gradtie bench --peers --suite peers-gpu --rounds 3 --out "$PEERS_OUT"
echo "wrote $PEERS_OUT"
