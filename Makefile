# Quickstart: `make run` (the quickstart campaign) and `make test` (the test suite).
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-slow bench graphviz clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,postgres]"
	touch $(STAMP)

# Graphviz renders plan pictures (SVG); without it plans are still written as .dot files.
graphviz:
	@command -v dot >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  { apt-get install -y -q graphviz >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q graphviz >/dev/null; }; }; } || \
	  echo "note: Graphviz 'dot' is not installed; pictures will be written as .dot only"

# The quickstart campaign starts afresh each time (its archive is out/quickstart.db).
run: $(STAMP) graphviz
	mkdir -p out && rm -f out/quickstart.db out/quickstart.db-wal out/quickstart.db-shm
	$(VENV)/bin/tapestry run configs/quickstart.yaml --db out/quickstart.db
	$(VENV)/bin/tapestry status quickstart --db out/quickstart.db
	$(VENV)/bin/tapestry export quickstart --db out/quickstart.db --out out/quickstart

# The suite without the end-to-end campaign tests marked `slow` (local Dask clusters, CLI
# subprocesses, whole-model cost evaluations): under 8 minutes on 2 cores. CI runs both.
# Two worker processes (pytest-xdist), each taking a whole test file at a time, so a file's
# tests keep their order: 4:57 -> 2:55 on the 2-core development VM (the suite alone took 7:46
# under CI, close to its 8-minute budget).
test: $(STAMP) graphviz
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile

test-slow: $(STAMP) graphviz
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) scripts/bench_ir.py
	$(PY) scripts/bench_costmodel.py
	$(PY) scripts/bench_farm.py

clean:
	rm -rf out .pytest_cache .hypothesis
