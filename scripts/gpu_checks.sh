#!/usr/bin/env bash
# Every GPU check of this repository in one run, for a lent GPU machine (the device tool's bare
# image: CuPy, torch and NumPy there, this project's other dependencies carried as wheels in .whl/,
# made here by scripts/gpu_wheels.sh). Each step has its own time limit, so one that hangs leaves the
# others' results. Logs and JSON go to $OUT (default out/gpu).
#   bash scripts/gpu_checks.sh [fidelity_s=240] [bench_gpu_s=150] [pytest_s=120]
set -u
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c "import sys, numpy, numba, cupy; print(sys.version.split()[0], 'numpy', numpy.__version__,
'numba', numba.__version__, 'cupy', cupy.__version__)"; nproc; } 2>&1 | tee "$OUT/machine.txt"
step() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local t=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t)) s"; tail -25 "$OUT/$name.log" | cut -c1-400
}
step fidelity "${1:-240}" python3 scripts/bench_fidelity.py --backend cupy --rounds 2 --repeats 3 --json "$OUT/fidelity.json" \
  --records "$OUT/fidelity_records.json"
step bench_gpu "${2:-150}" python3 scripts/bench_gpu.py --json "$OUT/bench_gpu.json"
step pytest_gpu "${3:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
