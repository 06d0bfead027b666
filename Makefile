# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# Three xdist workers on two cores, one test file each at a time (--dist loadfile): the tests wait
# on subprocesses, servers and clusters about a third of their time (1,191 s of test time took
# 773 s of CPU), so a third worker fills the cores (632 s -> 422 s, 2026-12-05). A file's module-scoped
# fixtures (a NATS or Ray cluster, a trained run) are made once and its tests run in order,
# as they do without xdist. Every file already keeps to its own ports (port 0 or free_ports),
# temporary folders and, for the agent CLIs, its own HOME; Ray is started by one file only.
PYTEST_ARGS ?= -m "not slow" -n 3 --dist loadfile --durations=30

.PHONY: demo test lint bench clean-venv

# Torch goes in first, on its own: that takes the local CPU wheel instead of
# letting a bare `torch` requirement pull a multi-GB CUDA build. The install
# also builds the compiled accelerators (setup.py; skipped with a warning
# without a C compiler), so a changed C source reinstalls too.
$(VENV)/.installed: pyproject.toml setup.py events/log/_framecodec.c events/schema/_speedups.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/agentlog demo

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

# Static checks ([tool.ruff] and [tool.mypy] in pyproject.toml). mypy type-checks the
# `agentlog` package, which is the repository root itself: build/mypy/agentlog holds a link
# to each of the package's top-level modules and layer folders (a link to the root would
# let mypy walk into build/ again), and [tool.mypy] mypy_path points there.
MYPY_SHIM := build/mypy/agentlog
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	rm -rf $(MYPY_SHIM) && mkdir -p $(MYPY_SHIM)
	for p in *.py */__init__.py; do \
		top=$${p%%/*}; case $$top in setup.py|tests) continue;; esac; \
		ln -sfn "$(CURDIR)/$$top" $(MYPY_SHIM)/$$top; \
	done
	$(VENV)/bin/mypy

# Every benchmark, one at a time, kept in runs/bench and compared with the last run of its kind
# (BENCH_ARGS=--quick for the small sizes); see tools/bench/run_goals.py.
bench: $(VENV)/.installed
	$(PY) tools/bench/run_goals.py --history runs/bench $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
