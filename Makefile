# Set-up on a fresh machine is part of every target: `make demo` and `make test`
# create .venv, install towers with TensorFlow and the test tools, then run.
PYTHON ?= python3
# cpu (tensorflow-cpu) or gpu (tensorflow[and-cuda]); see README.
TF_EXTRA ?= cpu
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed-$(TF_EXTRA)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test test-slow bench docs lint clean keras-tests

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): setup.cfg pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(TF_EXTRA),test,demo]"
	# keras-hub, for tests/test_real_models.py. Its wheel requires tensorflow-text,
	# which pulls the full tensorflow wheel in over tensorflow-cpu (the same module
	# twice). A model built from a config imports without it, so keras-hub comes
	# pinned and without its dependencies, with the two it needs to import.
	$(BIN)/python -m pip install -q --no-deps keras-hub==0.32.0 regex==2026.11.15 \
		tokenizers==0.23.3
	touch $@

demo: $(INSTALLED)
	$(BIN)/towers demo

# The suite in one process per core, at most two (pytest-xdist; each process
# sets its own logical CPUs in conftest.py), but the slow tier.
test: $(INSTALLED)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=2 -m "not slow and not alone"

# The slow tier (tests/conftest.py's SLOW: real processes, real models, XLA;
# cluster tests take free ports), then the cases marked `alone` (they time other
# processes' answers) by themselves. CI (.ci/run) runs `make test` and this.
test-slow: $(INSTALLED)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=2 -m "slow and not alone"
	$(BIN)/python -m pytest -q -m alone

bench: $(INSTALLED)
	$(BIN)/python -m pytest benchmarks -q -o python_files='bench_*.py' \
		--benchmark-columns=median,iqr,rounds --benchmark-sort=name

# Keras' own tests of fit, evaluate, predict and its callbacks (in the Keras
# wheel), every fit, evaluate and predict routed through towers on 2 logical
# CPUs (tests/keras_suite/route.py); then the same files on Keras alone, to
# compare. trainer_test.py imports jax: it goes to .keras-tests, not .venv;
# so does our own test of jax's sparse arrays as input, run first.
KERAS_SRC = $(shell $(BIN)/python -c "import keras, os; print(os.path.dirname(keras.__file__))" 2>/dev/null)/src
KERAS_TESTS ?= $(KERAS_SRC)/trainers/trainer_test.py $(KERAS_SRC)/callbacks
keras-tests: $(INSTALLED)
	test -d .keras-tests || $(BIN)/python -m pip install -q --no-deps \
		--target .keras-tests jax==0.10.2 jaxlib==0.10.2
	PYTHONPATH=$(CURDIR):$(CURDIR)/.keras-tests $(BIN)/python -m pytest -q \
		-p no:cacheprovider tests/keras_suite/jax_sparse.py
	cd /tmp && PYTHONPATH=$(CURDIR):$(CURDIR)/.keras-tests $(CURDIR)/$(BIN)/python \
		-m pytest -q -p tests.keras_suite.route -p no:cacheprovider -n 2 \
		-p no:warnings --rootdir /tmp $(KERAS_TESTS) -rf || true
	cd /tmp && PYTHONPATH=$(CURDIR)/.keras-tests $(CURDIR)/$(BIN)/python -m pytest \
		-q -p no:cacheprovider -n 2 -p no:warnings --rootdir /tmp $(KERAS_TESTS) -rf

# The API reference, from the docstrings (pdoc), into docs/api/index.html.
docs: $(INSTALLED)
	$(BIN)/python docs/build_api.py docs/api

lint: $(INSTALLED)
	$(BIN)/ruff check towers tests benchmarks examples conftest.py
	$(BIN)/ruff format --check towers tests benchmarks examples conftest.py

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks *.egg-info docs/api .keras-tests
