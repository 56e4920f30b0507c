# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# With no GPU, install the CPU build of torch first: a bare `torch` requirement
# would otherwise pull a multi-GB CUDA build. The CPU build by name (a local wheel, a
# mirror), else from PyTorch's CPU index: PyPI's Linux torch is the CUDA build.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_VERSION ?= 2.13.0

.PHONY: demo test test-all install install-dev bench clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	touch $@

$(VENV)/.installed: $(VENV)/.created pyproject.toml
ifeq ($(HAS_GPU),)
	$(PIP) install -q "torch==$(TORCH_VERSION)+cpu" \
		|| $(PIP) install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu
endif
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(VENV)/bin/pdserve demo

# A pytest killed by a signal (a native library's abort) gets its test and our frames printed
# last, where CI's tail shows them (tests/crash_witness.py).
CRASH_LOG := .cache/pytest-crash

test: $(VENV)/.installed-dev
	rc=0; PDSERVE_CRASH_LOG=$(CRASH_LOG) $(PY) -m pytest -q tests || rc=$$?; \
	$(PY) tests/crash_report.py $(CRASH_LOG) $$rc; exit $$rc

# Everything, slow tests included.
test-all: $(VENV)/.installed-dev
	$(PY) -m pytest -q -m "not gpu" tests

bench: $(VENV)/.installed
	$(VENV)/bin/pdserve bench offline

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
