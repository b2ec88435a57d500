#!/usr/bin/env bash
# A contributor's inner loop: the unit tests of the shared code and one
# parity test per backend, on JAX, TensorFlow and torch at once (one pytest
# process per backend, in parallel; logs printed in backend order).
# Leaves out what is marked `slow`, `multi_device` or `multi_process`
# unless it is also marked `fast`. Run `bash tools/test_all.sh` (what CI
# runs) before pushing.
#
#   bash tools/test_fast.sh                # all three backends
#   bash tools/test_fast.sh -x -k device   # extra arguments go to pytest
#   KERAS_DIST_BACKENDS="jax torch" bash tools/test_fast.sh
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${KERAS_DIST_VENV:-.venv}"
if ! "$VENV/bin/python" -c "import keras, pytest" 2>/dev/null; then
  echo "No test environment in $VENV: run 'bash tools/test_all.sh' once" \
    "(it installs requirements/ci.txt), or set KERAS_DIST_VENV." >&2
  exit 1
fi
BACKENDS="${KERAS_DIST_BACKENDS:-jax tensorflow torch}"
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
start=$SECONDS
declare -A pids
for backend in $BACKENDS; do
  (
    # Wall time, and CPU time (what the loop would need of idle cores).
    TIMEFORMAT="[$backend: %0R s wall, %0U s user + %0S s sys CPU]"
    time KERAS_BACKEND="$backend" "$VENV/bin/python" -m pytest -q \
      -p no:cacheprovider --durations=5 \
      -m "fast or not (slow or multi_process or multi_device)" tests "$@"
  ) >"$LOGS/$backend.log" 2>&1 &
  pids[$backend]=$!
done
status=0
for backend in $BACKENDS; do
  wait "${pids[$backend]}"
  rc=$?
  echo "=== KERAS_BACKEND=$backend (fast) ==="
  cat "$LOGS/$backend.log"
  # 5 means "no tests collected", which is not a failure of that backend.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
done
echo "=== fast loop: $((SECONDS - start)) s for $BACKENDS (exit $status) ==="
exit "$status"
