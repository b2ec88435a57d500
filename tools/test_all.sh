#!/usr/bin/env bash
# Installs what the tests need (pinned CPU builds) into .venv and runs the
# lint and the whole test suite once per Keras backend.
#
# The backends run in two lanes at once — TensorFlow (the longest) beside
# JAX then torch — since most tests keep one core busy; on a 2-core machine
# that cuts the wall time by about a third. KERAS_DIST_LANES=1 runs the
# three one after the other. Each lane's output is printed when it ends.
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

run_backend() {
  local backend=$1 began=$SECONDS
  echo "=== KERAS_BACKEND=$backend ==="
  KERAS_BACKEND="$backend" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    --durations=15 tests
  local rc=$?
  echo "=== KERAS_BACKEND=$backend: exit $rc after $((SECONDS - began)) s ==="
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
  run_backend tensorflow >"$LOGS/tensorflow.log" 2>&1 &
  tf_pid=$!
  { run_backend jax; a=$?; run_backend torch; b=$?; exit $((a || b)); } \
    >"$LOGS/jax_torch.log" 2>&1 &
  other_pid=$!
  wait "$other_pid" || status=1
  cat "$LOGS/jax_torch.log"
  wait "$tf_pid" || status=1
  cat "$LOGS/tensorflow.log"
fi
echo "=== all backends: $((SECONDS - start)) s (exit $status) ==="
exit "$status"
