#!/usr/bin/env bash
# Prepares what benchmarks/gpu_benchmarks.sh needs on a GPU machine that has no network and no ../shared:
#   .gpu/torch-reference   the reference fixtures (trained weights, parity data) from ../shared
#   .gpu/Routing-MVMoE     the authors' code, copied from AUTHORS_CODE (a local checkout; not committed)
#   .whl/                  wheels of pure-Python dependencies the GPU image lacks (ml_collections)
# Both folders are git-ignored; copy them to the GPU machine with the working tree, and run there
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#   PYTHONPATH=$PWD:/tmp/site bash benchmarks/gpu_benchmarks.sh $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
AUTHORS_CODE=${AUTHORS_CODE:-${MVMOE_AUTHORS_CODE:-}}
mkdir -p .gpu .whl
rm -rf .gpu/torch-reference && cp -r ../shared/fixtures/torch-reference .gpu/torch-reference
if [ -n "$AUTHORS_CODE" ]; then
  rm -rf .gpu/Routing-MVMoE && cp -r "$AUTHORS_CODE" .gpu/Routing-MVMoE && rm -rf .gpu/Routing-MVMoE/.git
else
  echo "AUTHORS_CODE (or MVMOE_AUTHORS_CODE) not set: the authors' steps will be skipped with an error" >&2
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl ml_collections
du -sh .gpu .whl
