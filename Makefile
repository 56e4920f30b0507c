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
# PyPI's connection here sometimes drops in the middle of a large wheel (triton is ~290 MB), and
# pip gives up after 5 resumes: resume more often, and retry a failed install as a whole.
# (An environment variable, not the flag, so a pip too old to know it ignores it.)
export PIP_RESUME_RETRIES := 20
PIP_TRIES := 3
pip_install = n=1; until $(PIP) install -q $(1); do \
	[ $$n -lt $(PIP_TRIES) ] || exit 1; \
	echo "pip install failed (try $$n of $(PIP_TRIES)); retrying" >&2; n=$$((n+1)); sleep 10; done

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
	$(call pip_install,-e .)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(call pip_install,-e ".[dev]")
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
