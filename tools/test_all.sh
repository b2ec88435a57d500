#!/usr/bin/env bash
# Installs what the tests need (pinned CPU builds) into .venv and runs the
# lint and the whole test suite once per Keras backend.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${KERAS_DIST_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 1
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  -r requirements/ci.txt -e . || exit 1
"$VENV/bin/python" -m ruff check keras_dist tests examples benchmarks || exit 1
"$VENV/bin/python" -m ruff format --check keras_dist tests examples benchmarks \
  || exit 1
status=0
for backend in jax tensorflow torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  KERAS_BACKEND="$backend" "$VENV/bin/python" -m pytest -q --durations=15 tests
  rc=$?
  # 5 means "no tests collected", which is not a failure of that backend.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
done
exit "$status"
