# `make demo` and `make test` set themselves up: a venv in .venv, torch first (pinned), then the package.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
NPROC  ?= 2

.PHONY: setup lint test test-fast fuzz demo demo-zero3 demo-tp demo-2d demo-cp demo-big bench bench-zero3 clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# pin the torch just installed, so that no dependency swaps it for a (multi-GB CUDA) other build
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	$(PY) -m pip list 2>/dev/null | grep -E "^(torch|onnx|onnxruntime) "
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check .

# Two pytest workers (pytest-xdist): most of a test's time is single-threaded Python (tracing, passes, ONNX export),
# so two workers use both cores; they share the run's ONNX cache (tests/conftest.py: one directory, locked writes).
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=25

# The inner loop: the single-process tests (no torchrun), those marked slow left out; `make test` stays the whole suite.
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m "not multiproc and not slow"

# The differential fuzzer with a large budget (tests/test_fuzz.py; `make test` runs a few fixed examples):
# FUZZ_EXAMPLES random train steps on fx and FUZZ_EXAMPLES/8 on ort, each trained eagerly and compiled.
FUZZ_EXAMPLES ?= 300
fuzz: setup
	FUZZ_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k "fuzz_fx or fuzz_ort" --hypothesis-show-statistics

demo: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_char_gpt.py

demo-zero3: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_char_gpt.py --parallel fully_shard

demo-tp: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_char_gpt.py --parallel tp

demo-2d: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=4 examples/train_char_gpt.py --parallel 2d

# Context parallel (docs/context-parallel.md): each 512-character sequence split over the ranks.
demo-cp: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_char_gpt.py --parallel cp --seq 512 --batch 8

# A model bigger than one rank (docs/big-models.md): a bigger GPT built on the meta device, parallelize, to_empty,
# its own init on each rank's part; each rank's memory against the full model's, the weights saved to out/demo_big/.
# DEMO_ARGS="--init-from out/demo_big" trains on from them; "--parallel tp" (or NPROC=4 and "--parallel 2d") lays out.
DEMO_ARGS ?=
demo-big: setup
	$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) examples/train_char_gpt.py --big $(DEMO_ARGS)

bench: setup
	$(PY) bench/step.py --compile
	$(PY) bench/optim.py
	$(PY) bench/fused_head.py

bench-zero3: setup
	$(PY) -m pip install -q -c $(VENV)/constraints.txt "deepspeed>=0.16"
	DS_ACCELERATOR=cpu $(PY) bench/zero3.py --repeat 3

clean:
	rm -rf $(VENV) build *.egg-info
