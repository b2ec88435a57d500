#!/usr/bin/env bash
# Builds the docs site into build/site and fails on a broken link or
# reference, a stale API page, or a public name without a docstring.
#
#   python3 -m venv /tmp/docsvenv && /tmp/docsvenv/bin/pip install -r requirements/docs.txt
#   DOCS_PYTHON=/tmp/docsvenv/bin/python bash tools/build_docs.sh
#
# DOCS_PYTHON runs mkdocs (requirements/docs.txt; no Keras needed: the
# reference is read from the source with griffe). PYTHON runs the
# docstring check, which imports keras_dist with the JAX backend
# (default .venv/bin/python, the test environment).
set -euo pipefail
cd "$(dirname "$0")/.."
DOCS_PYTHON="${DOCS_PYTHON:-python3}"
PYTHON="${PYTHON:-.venv/bin/python}"

KERAS_BACKEND=jax PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$PYTHON" tools/check_docstrings.py
"$DOCS_PYTHON" tools/gen_api_pages.py --check

# mkdocs reads one folder: stage the pages there with the layout of the
# repository, so that the links between README, guides and files work.
stage=build/docs_src
rm -rf "$stage"
mkdir -p "$stage"
cp -r docs/. "$stage/"
cp README.md "$stage/index.md"
cp CHANGELOG.md CONTRIBUTING.md LICENSE "$stage/"
mkdir -p "$stage/guides" "$stage/benchmarks" "$stage/examples"
cp guides/*.md "$stage/guides/"
cp -r guides/images "$stage/guides/images"
cp benchmarks/*.py benchmarks/*.json benchmarks/README.md "$stage/benchmarks/"
cp examples/*.py "$stage/examples/"
# The README is the site's home page (index.md): links to it follow.
find "$stage" -name '*.md' -exec sed -i 's#\.\./README\.md#../index.md#g' {} +

"$DOCS_PYTHON" -m mkdocs build --strict --clean
echo "docs: built build/site"
