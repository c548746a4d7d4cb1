# trajmesh — make targets. `make setup` once, then `make demo` or `make test`.
PY ?= .venv/bin/python
VENV_OK := .venv/.installed

.PHONY: setup test test-all lint proto bench demo clean

$(VENV_OK): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[learner,deepspeed,dev]'
	touch $(VENV_OK)

setup: $(VENV_OK)

test: setup
	$(PY) -m pytest -m "not slow and not gpu" -q

test-all: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check trajmesh learner rollout envs graders services tests bench
	$(PY) -m mypy trajmesh learner

proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/trajmesh/v1/*.proto

bench: setup
	$(PY) bench/run.py

demo: setup
	$(PY) -m trajmesh.cli train examples/demo.yaml --fresh

clean:
	rm -rf runs .pytest_cache
