# The entry points: `make demo`, `make test` and `make docs`. Each creates .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all bench clean install docs

# the test suite's worker processes (pytest-xdist; `make test WORKERS=0` runs it in this one process). Two
# keep both CI cores busy: a case spends much of its time waiting on the processes it launches. The netbed's
# cases run one at a time (tests/conftest.py: a lock, one per machine). The cases marked `timing` measure
# the machine (a shaped link's rate, a model against a measured run): they run first, alone, each once the
# CPU is quiet (tests/conftest.py), as a second worker's load slows what they measure by up to 1.4x.
WORKERS ?= 2
XDIST = -n $(WORKERS) --dist load

$(STAMP): setup.py setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[experiments,netbed,test,docs,lightning,accelerate]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	WANDB_MODE=offline $(PY) -m experiments.demo

TESTENV = WANDB_MODE=disabled NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache

test: $(STAMP)
	$(TESTENV) $(PY) -m pytest -q -m "timing and not slow"; rc=$$?; \
	$(TESTENV) $(PY) -m pytest -q --durations=30 -m "not slow and not timing" $(XDIST) || rc=1; exit $$rc

test-all: $(STAMP)
	$(TESTENV) $(PY) -m pytest -q -m "timing"; rc=$$?; \
	$(TESTENV) $(PY) -m pytest -q -m "not timing" $(XDIST) || rc=1; exit $$rc

# the documentation site into site/ (open site/index.html); any warning fails the build (mkdocs.yml: strict)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: $(STAMP)
	$(PY) -m experiments.bench.codec
	$(PY) -m experiments.bench.compressors
	$(PY) -m experiments.bench.transports

clean:
	rm -rf $(VENV) .numba_cache build site *.egg-info
