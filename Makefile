# Fresh-machine entry points: `make demo` and `make test`. Each creates ./.venv and
# installs what it needs into it; nothing is installed system-wide.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= build/demo
# Never let the checkout's own `kernels/` folder shadow Hugging Face's `kernels` package
# through the current directory on sys.path (Python >= 3.11 honours this).
export PYTHONSAFEPATH := 1

.PHONY: demo test install-core install-all clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Core + test extras: enough for the cast, the kernels (Triton interpreter on CPU) and the demo.
$(VENV)/.core-installed: pyproject.toml setup.py | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# Everything, including SGLang 0.5.23 for the plugin tests (about 5 minutes, 11 GB).
$(VENV)/.all-installed: pyproject.toml setup.py | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[sglang,test]"
	touch $(VENV)/.core-installed $@

install-core: $(VENV)/.core-installed
install-all: $(VENV)/.all-installed

demo: install-core
	$(PY) -m k3nvfp4.demo --workdir $(DEMO_DIR)

# Two workers, one test file each at a time (module fixtures such as the K3 servers are started
# once); the slowest files are scheduled first (tests/conftest.py), which needs
# --no-loadscope-reorder: by default xdist hands out the files with the most tests first.
# TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: install-all
	$(VENV)/bin/pytest -q tests $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=25

clean:
	rm -rf build .pytest_cache .hypothesis
