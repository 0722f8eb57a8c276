#!/usr/bin/env bash
# Downloads into .whl/ the wheels that the device tool's GPU image (Python 3.12, CuPy, torch, NumPy,
# numba) lacks of this project's dependencies, at the versions installed in .venv (the ones tested
# here), for scripts/gpu_checks.sh: run here, then name .whl in the device call's carry.
#   bash scripts/gpu_wheels.sh          # then: device run `bash scripts/gpu_checks.sh`, carry [".whl"]
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PY=${PY:-.venv/bin/python}
pkgs="alembic annotated-types colorlog dask distributed locket mako optuna partd pydantic pydantic-core sqlglot
tblib typing-inspection zict sqlalchemy tornado moocore cffi pycparser typing-extensions platformdirs"
plats=""
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plats="$plats --platform $p"; done
for p in $pkgs; do
  v=$("$PY" -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  [ -n "$v" ] || { echo "gpu_wheels: $p is not installed in $PY's environment (make .venv first)" >&2; exit 2; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plats \
    -d .whl "$p==$v" 2>&1 | grep -v "^WARNING: Location" || true
done
ls .whl | wc -l | xargs echo "gpu_wheels: wheels in .whl:"
