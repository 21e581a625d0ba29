#!/usr/bin/env bash
# The GPU run, in one command: ResNet-34 at 224 px, 1000 classes, batch 64 and 256, under each
# execution policy (bf16, tf32, tie). Per configuration, in fresh processes: the rendered step against
# autodiff of the same forward (interleaved), plain JAX at the policy's precision, and PyTorch eager as
# users run it (bf16 autocast + channels_last, TF32 on, TF32 off), where PyTorch is installed. Then what
# XLA's GPU backend keeps of a bf16 rounding, with and without --xla_allow_excess_precision=false.
# Writes benchmarks/results/gpu.json (rendered, autodiff, MFU against the policy's units, the cuDNN
# kernels the rendered program runs) and benchmarks/results/peers_gpu.json, after every configuration,
# so a run cut short keeps what it measured; prints the table and the goals.
#
# Installs nothing beyond the README's GPU step:  .venv/bin/pip install -U "jax[cuda12]"
# Usage:  benchmarks/gpu.sh [OUT.json]      (PEERS_OUT=... for the peers' file; about 6 minutes on one
#                                            H200, compiles included: every program compiles at once)
#
# Before spending device time, check on a CPU what the GPU will compile (no GPU needed):
#         .venv/bin/python -m pytest tests/test_lowered.py      # the policies' programs, lowered for CUDA
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-benchmarks/results/gpu.json}
PEERS_OUT=${PEERS_OUT:-benchmarks/results/peers_gpu.json}
"$PY" - <<'PYEOF'
import sys, jax
if jax.default_backend() != "gpu":
    sys.exit(f"benchmarks/gpu.sh: JAX sees no GPU (backend {jax.default_backend()!r}); install the CUDA "
             "build first: .venv/bin/pip install -U 'jax[cuda12]' (README, 'On a GPU')")
print(f"{jax.local_device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}")
PYEOF
# The compiles, not the steps, are what takes the time: every program is compiled at once into JAX's
# persistent cache, then each configuration runs in a fresh process that loads them.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$HOME/.cache/gradtie-jax}
# the compiling process stays alive while the measuring ones run (and PyTorch's): no process takes
# most of the GPU's memory up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
"$PY" -m gradtie bench --suite gpu --out "$OUT" --peers-out "$PEERS_OUT"
