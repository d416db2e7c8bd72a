#!/usr/bin/env bash
# Device check for the data plane (gpu_pool/, kernels/): run on a machine with a CUDA GPU.
# Runs the `gpu`-marked tests (compiled Triton on CUDA: page copies, and the vLLM connector's tile
# copies against their torch path; CUDA IPC to a spawned worker) and the restore benchmark, and
# writes everything under $OUT (default ./gpu_check_out):
#   env.txt            nvidia-smi, torch/triton versions
#   pytest.log, pytest.xml
#   bench.json         `python -m cachetier.bench.restore --json` on cuda
#   bench.log          its stderr
# Exit status: non-zero if CUDA is missing, a test failed, or the benchmark failed.
# Needs a CUDA build of torch: set PYTHON to its interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_check_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
unset TRITON_INTERPRET  # compiled kernels only: the tests assert the triton backend ran on cuda

{ nvidia-smi || true; "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "available", torch.cuda.is_available())'; } >"$OUT/env.txt" 2>&1
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA device visible to $PY (see $OUT/env.txt)" >&2
    exit 2
fi

status=0
timeout 300 "$PY" -m pytest -m gpu -q -rs --junitxml="$OUT/pytest.xml" \
    tests/test_kernels.py tests/test_kv_copy_kernels.py tests/test_pool.py >"$OUT/pytest.log" 2>&1 || status=1
timeout 240 "$PY" -m cachetier.bench.restore --device cuda --json >"$OUT/bench.json" 2>"$OUT/bench.log" || status=1
tail -n 3 "$OUT/pytest.log"
cat "$OUT/bench.json"
exit $status
