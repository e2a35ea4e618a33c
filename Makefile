# Two commands on a fresh machine: `make demo` and `make test`. Both install first (quick once done).

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Reinstall when the package's or an integration's metadata changes.
INTEGRATIONS := $(patsubst %/pyproject.toml,%,$(wildcard integrations/*/pyproject.toml))
STAMP := $(VENV)/.installed

# Everything runs from local files: nothing may reach a model hub.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_PROGRESS_BARS := 1

.PHONY: install test lint demo bench clean

install: $(STAMP)
	$(VENV)/bin/cacheblend-rag models pull

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first: it is a local CPU wheel here; resolved later, pip could fetch a multi-GB CUDA build instead.
# torchvision from PyPI does not match the CPU torch and breaks transformers' imports: never keep it.
$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS)) | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[langchain,llamaindex,dev,eval]' $(addprefix -e ,$(INTEGRATIONS))
	@if $(PIP) show --quiet torchvision 2>/dev/null; then $(PIP) uninstall --yes torchvision; fi
	touch $@

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: install
	$(PY) examples/demo.py

bench: install
	$(VENV)/bin/cacheblend-rag bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis .benchmarks bench-tmp
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
