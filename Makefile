# Everything a fresh machine needs goes through these targets: `make serve`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUF := node_modules/.bin/buf
HOST ?= 127.0.0.1
PORT ?= 50051
ENV ?= echo

.PHONY: install serve test pytest lint proto proto-check clean bench-echo

# The virtualenv is rebuilt when the project's dependencies change.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

$(BUF): package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	touch $@

install: $(VENV)/.installed $(BUF)

## serve: run a server with the default environment on localhost (no Docker)
serve: $(VENV)/.installed
	$(VENV)/bin/openenv-grpc serve $(ENV) --host $(HOST) --port $(PORT)

## test: the whole suite: lint, generated-code drift, then every test
test: lint proto-check pytest

pytest: $(VENV)/.installed
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	@# envs/ imports as openenv_grpc_envs only through the editable install's import hook,
	@# which mypy cannot follow: a symlink gives it the package under its import name.
	mkdir -p build/mypy && ln -sfn "$(CURDIR)/envs" build/mypy/openenv_grpc_envs
	MYPYPATH=build/mypy $(VENV)/bin/mypy --strict --exclude '_pb2' --exclude '/tests/' -p openenv_grpc_envs
	$(BUF) lint

## proto: regenerate Python messages, stubs and type stubs from proto/
proto: $(VENV)/.installed
	$(PY) scripts/protogen.py

proto-check: $(VENV)/.installed
	$(PY) scripts/protogen.py --check

clean:
	rm -rf $(VENV) node_modules build *.egg-info

## bench-echo: step latency at 1 session and throughput at 64 (numbers go to docs/benchmarks.md)
bench-echo: $(VENV)/.installed
	$(PY) -m bench.echo_load --sessions 1 64 --seconds 5
