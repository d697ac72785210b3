# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
DEEPSPEED_PIN := deepspeed==0.19.8

.PHONY: install demo test test-loaded clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

# DeepSpeed, for the ZeRO-3 launch test only: built against the torch above (in an isolated build it would fetch
# a CUDA torch of its own)
$(BIN)/.installed-deepspeed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet --no-build-isolation $(DEEPSPEED_PIN)
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/logitless demo

test: install $(BIN)/.installed-deepspeed
	$(BIN)/python -m pytest -q

# the suite with two processes keeping two cores busy beside it, as on a shared machine
test-loaded: install $(BIN)/.installed-deepspeed
	$(BIN)/python -m logitless.bench.busy 2 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
