#!/usr/bin/env bash
# Installs what the tests need (pinned CPU builds) into .venv and runs the
# lint and the whole test suite once per Keras backend.
#
# The backends run in two lanes at once — TensorFlow then torch's feature
# matrix and layout tests beside JAX then the rest of torch — since most tests keep one core
# busy; on a 2-core machine that cuts the wall time by about a third.
# KERAS_DIST_LANES=1 runs the three one after the other. Each lane's output
# is printed when it ends.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${KERAS_DIST_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 1
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  -r requirements/ci.txt -e . || exit 1
"$VENV/bin/python" -m ruff check keras_dist tests examples benchmarks || exit 1
"$VENV/bin/python" -m ruff format --check keras_dist tests examples benchmarks \
  || exit 1
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
start=$SECONDS

# run_backend BACKEND [PYTEST ARGS...] (default: every test);
# KERAS_DIST_PYTEST_ARGS adds arguments to every run (e.g. -x).
run_backend() {
  local backend=$1 began=$SECONDS
  shift
  [ "$#" -gt 0 ] || set -- tests
  echo "=== KERAS_BACKEND=$backend $* ==="
  # shellcheck disable=SC2086
  KERAS_BACKEND="$backend" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    --durations=15 "$@" ${KERAS_DIST_PYTEST_ARGS:-}
  local rc=$?
  echo "=== KERAS_BACKEND=$backend $*: exit $rc after $((SECONDS - began)) s ==="
  # 5 means "no tests collected", which is not a failure of that backend.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then return "$rc"; fi
  return 0
}

status=0
if [ "${KERAS_DIST_LANES:-2}" = "1" ]; then
  for backend in jax tensorflow torch; do
    run_backend "$backend" || status=1
  done
else
  # Measured on 2 December 2026: TensorFlow 2018 s then torch's feature
  # matrix and layout tests 350 s (2368 s) beside JAX 1199 s then the rest
  # of torch 1035 s (2234 s); on 4 December, a faster machine: 951 + 242
  # beside 635 + 620 s.
  MATRIX=tests/test_feature_matrix.py
  LAYOUTS=tests/torch/test_torch_model_parallel.py
  { run_backend tensorflow; a=$?; run_backend torch "$MATRIX" "$LAYOUTS"
    b=$?; exit $((a || b)); } >"$LOGS/tensorflow.log" 2>&1 &
  tf_pid=$!
  { run_backend jax; a=$?
    run_backend torch tests --ignore="$MATRIX" --ignore="$LAYOUTS"; b=$?
    exit $((a || b)); } >"$LOGS/jax_torch.log" 2>&1 &
  other_pid=$!
  wait "$other_pid" || status=1
  cat "$LOGS/jax_torch.log"
  wait "$tf_pid" || status=1
  cat "$LOGS/tensorflow.log"
fi
echo "=== all backends: $((SECONDS - start)) s (exit $status) ==="
exit "$status"
