# Every target installs what it needs into .venv first, so a fresh clone needs only Python.
PYTHON ?= python3  # Any 3.11 or later, whichever patch release (Debian 12 has 3.11.2).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: example test test-py313 test-tf bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,examples,checkpoint]"
	touch $(STAMP)

example: $(STAMP)
	$(PY) examples/train_digits.py

test: $(STAMP)
	$(PY) -m mypy --no-error-summary
	$(PY) -m pytest -q -n 2

# The suite on Python 3.13 with the newest JAX pyproject.toml admits (pip picks it), in the
# Debian root ../shared/tools/py313 builds (once, about 3 minutes; needs root): the other end of
# the supported range from `make test` (jax 0.10 on this machine's Python 3.11).
PY313 := ../shared/tools/py313

test-py313:
	$(PY313) make test VENV=.venv-py313

# The tests that compare jdist with TensorFlow's own tf.distribute (they skip under `make test`,
# whose environment has no TensorFlow): a separate environment with the `tf` extra.
TF_VENV := .venv-tf
TF_STAMP := $(TF_VENV)/.installed
BENCH_STAMP := $(TF_VENV)/.installed-bench

$(TF_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TF_VENV)/bin/python -m pip install --quiet -e ".[test,tf]"
	touch $(TF_STAMP)

test-tf: $(TF_STAMP)
	$(TF_VENV)/bin/python -m pytest -q -n 2 tests/test_tf_conformance.py tests/test_tf_random.py \
		tests/test_tf_gradients.py tests/test_tf_extended.py tests/test_tf_losses.py \
		tests/test_input_tf.py tests/test_auto_shard.py tests/test_numpy_dataset_tf.py \
		tests/test_multi_worker_tf.py tests/test_tf_training.py tests/test_iterator_state_tf.py

# The benchmarks run in the TF environment, so the scaling figure has TF's curve beside jdist's.
$(BENCH_STAMP): $(TF_STAMP)
	$(TF_VENV)/bin/python -m pip install --quiet -e ".[bench]"
	touch $(BENCH_STAMP)

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

# Runs every benchmark, then writes docs/benchmarks.md and docs/img/scaling.png from their figures.
bench: $(BENCH_STAMP)
	$(TF_VENV)/bin/python benchmarks/run_all.py

# Builds the documentation site into site/ (warnings are errors).
docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(TF_VENV) .venv-py313 .pytest_cache .hypothesis build site benchmarks/results *.egg-info
