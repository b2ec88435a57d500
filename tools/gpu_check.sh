#!/usr/bin/env bash
# The GPU checks, on a machine with NVIDIA GPUs and torch + JAX built for
# them (keras_dist from this checkout): tests/gpu for torch and JAX (real
# NCCL process groups, DTensor on a CUDA mesh, parity with plain Keras on
# the same GPU, a GPU checkpoint restored on CPU), `keras-dist doctor`, and
# the GPU step benchmarks (bench_fit --device-type gpu, BENCH_DEVICE=gpu
# bench_torch). CI has no GPU: there tests/gpu skips.
#
# Usage: bash tools/gpu_check.sh [LOG_DIR]   (logs: LOG_DIR/*.log)
# PYTHON (default python3) is the interpreter that holds the GPU builds;
# Keras and the test tools must be importable by it (PYTHONPATH will do).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
LOGS="${1:-$(mktemp -d)}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
began=$SECONDS

step() { # step NAME TIMEOUT COMMAND...: runs it, logs it, keeps the status
  local name=$1 limit=$2 t=$SECONDS
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -v "^I0000\|^W0000\|^WARNING: All log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t)) s"
  [ "$rc" -eq 0 ] || status=1
}

nvidia-smi -L 2>&1 | tee "$LOGS/gpus.log"
KERAS_BACKEND=jax "$PY" -c "import sys, keras, torch, jax; print(sys.version.split()[0], 'keras', keras.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'jax', jax.__version__, jax.devices())" 2>&1 | tee -a "$LOGS/gpus.log"

for backend in torch jax; do
  step "tests_$backend" 300 env KERAS_BACKEND=$backend "$PY" -m pytest -s -q \
    -p no:cacheprovider tests/gpu tests/torch/test_torch_devices.py
  step "doctor_$backend" 60 env KERAS_BACKEND=$backend "$PY" -m keras_dist.cli doctor
done
if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then  # GPU_CHECK_BENCH=0: tests only
  step bench_fit_jax 240 "$PY" benchmarks/bench_fit.py --backend jax \
    --device-type gpu --devices 1 --quick
  step bench_torch 300 env KERAS_BACKEND=torch BENCH_DEVICE=gpu "$PY" \
    benchmarks/bench_torch.py --steps 40 --repeats 3 \
    --modes keras,keras_dist,torch,ddp
fi
grep -h "GPU-FIGURE" "$LOGS"/tests_*.log
echo "gpu_check: status $status after $((SECONDS - began)) s"
exit $status
