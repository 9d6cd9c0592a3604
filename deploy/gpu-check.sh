#!/usr/bin/env bash
# The GPU suite and `ringleader bench gpu` on a machine with one CUDA device (docs/gpus.md).
#
#   deploy/gpu-check.sh fetch-wheels [DIR]   here, with a package index: the wheels a bare GPU
#                                            machine lacks (Ray without its Java jars, pydantic,
#                                            orjson, jsonschema's family), cp312 x86-64, into DIR
#   deploy/gpu-check.sh suite                there: pytest -m gpu (worker parts, then whole jobs)
#   deploy/gpu-check.sh bench                there: ringleader bench gpu, eager and compiled, then bench
#                                            overhead on the GPU
#   deploy/gpu-check.sh all                  there: both, the benches also after a failed test
#                                            (each fits a 10-minute call alone)
#
# Wheels found in $RINGLEADER_WHEELS (default .device-wheels) are installed first, without an
# index, into a private target on PYTHONPATH. Output (logs, JUnit XML with the tolerances each
# test used, the bench's JSON) goes to $OUT (default gpu-check-out). Nothing waits forever:
# each part runs under `timeout`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${RINGLEADER_WHEELS:-.device-wheels}
OUT=${OUT:-gpu-check-out}
SUITE_S=${SUITE_S:-570}
BENCH_S=${BENCH_S:-240}
OVERHEAD_S=${OVERHEAD_S:-90}
# What a machine with torch, numpy, pyarrow, pyyaml, requests, msgpack and protobuf lacks.
PACKAGES=(ray pydantic pydantic-core annotated-types typing-inspection orjson jsonschema
  jsonschema-specifications referencing rpds-py)

fetch_wheels() {
  local dir=${1:-$WHEELS} name version
  mkdir -p "$dir"
  for name in "${PACKAGES[@]}"; do
    # The versions this Python has (the ones the tests ran with), else the newest.
    version=$("$PY" -c "import importlib.metadata as m, sys
try: print('==' + m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$name")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir" "$name$version"
  done
  # Ray's wheel is ~79 MB, 30 MB of it ray/jars (Java), which Python never loads: repacked
  # without them (and their RECORD lines, so pip's hash check still holds) it fits a call.
  "$PY" - "$dir" <<'EOF'
import sys, zipfile
from pathlib import Path
for wheel in Path(sys.argv[1]).glob("ray-*.whl"):
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename.startswith("ray/jars/"):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(b"ray/jars/"))
            dst.writestr(item, data)
    slim.replace(wheel)
    print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.0f} MiB without ray/jars")
EOF
  du -sh "$dir"
}

install_wheels() {
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rl-site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/rl-site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # This checkout's packages, not an installed ringleader.
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  { nvidia-smi -L || true; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"; } | tee "$OUT/device.txt"
}

suite() {
  # Worker parts first: they need neither Ray nor a Ray wheel.
  timeout "$SUITE_S" "$PY" -m pytest -m gpu -rA -p no:cacheprovider --junitxml="$OUT/gpu-suite.xml" \
    tests/gpu/test_gpu_worker.py tests/gpu/test_gpu_nccl.py tests/pure/test_host_syncs.py tests/gpu/test_gpu_jobs.py 2>&1 | tee "$OUT/gpu-suite.log"
}

bench() {
  timeout "$BENCH_S" "$PY" -m ringleader bench gpu --json "$OUT/bench-gpu.json" 2>&1 | tee "$OUT/bench-gpu.log"
  timeout "$BENCH_S" "$PY" -m ringleader bench gpu --compile --json "$OUT/bench-gpu-compiled.json" 2>&1 |
    tee "$OUT/bench-gpu-compiled.log"
  timeout "$OVERHEAD_S" "$PY" -m ringleader bench overhead --device cuda --json "$OUT/bench-overhead.json" 2>&1 |
    tee "$OUT/bench-overhead.log"
}

case "${1:-all}" in
  fetch-wheels) fetch_wheels "${2:-}" ;;
  suite) install_wheels && suite ;;
  bench) install_wheels && bench ;;
  # The bench runs even where a test failed (its figures are worth having either way); the
  # exit status is the first failure's.
  all) install_wheels; rc=0; suite || rc=$?; bench || rc=$((rc ? rc : $?)); exit "$rc" ;;
  *) echo "usage: $0 fetch-wheels [DIR] | suite | bench | all" >&2; exit 2 ;;
esac
