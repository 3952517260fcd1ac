# spmdcall — set-up and main jobs. Every target creates .venv when it is missing.
#   make demo    set up, then run the main job (the examples for now)
#   make test    set up, then run the whole test suite
#   make bench   set up, then run the benchmarks (pytest-benchmark)
#   make docs    set up, then build the documentation site (strict)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch 2.13.0: the CPU wheel on developer machines; a CUDA build where pip finds one.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= rl,ray,dev,docs
STAMP  := $(VENV)/.installed

.PHONY: setup test demo bench bench-docs examples docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[$(EXTRAS)]"
	@touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

examples: setup
	@set -e; for f in examples/*.py; do echo "== $$f"; $(BIN)/python $$f; done

demo: examples

bench: setup
	@mkdir -p .benchmarks
	$(BIN)/python -m pytest benchmarks -q --benchmark-only --benchmark-columns=median,iqr,ops --benchmark-sort=name --benchmark-json=.benchmarks/latest.json
	$(BIN)/python benchmarks/report.py .benchmarks/latest.json --md .benchmarks/latest.md --png .benchmarks/latest.png

bench-docs: bench
	$(BIN)/python benchmarks/report.py .benchmarks/latest.json --md docs/benchmarks_table.md --png docs/benchmarks.png

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d build/site

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .benchmarks
