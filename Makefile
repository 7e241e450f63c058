# Everything a fresh machine needs goes through these targets: `make serve`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BUF := node_modules/.bin/buf
HOST ?= 127.0.0.1
PORT ?= 50051
ENV ?= echo

NODE_CLIENT := clients/node/node_modules/.installed
GOPATH_DIR := build/gopath

.PHONY: install dist serve test test-fast pytest lint proto proto-check clean bench-echo bench-gym clients go-play \
	buf-breaking system-deps image dockerd bench bench-vector bench-snapshots console \
	console-screenshot settings-table

# `local` = the registry-free debootstrap base; python:3.11-slim where a registry is reachable
BASE_IMAGE ?= local

# torch for the trl extra, installed first and pinned: pip takes this CPU build from the
# machine's disk; left to resolve it through trl, pip downloads a CUDA build of several GB.
TORCH_VERSION ?= 2.13.0

# The virtualenv is rebuilt when the project's dependencies change.
# Development (tests, lint, codegen): the package with every extra and tool.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# Serving: the package and its runtime dependencies, plus the env's own extra if it has
# one (nothing of [dev]: a fresh clone serves echo in seconds). A dev venv has it all.
SERVE_EXTRA_gymnasium := gymnasium
SERVE_EXTRA_openspiel := openspiel
SERVE_EXTRA := $(SERVE_EXTRA_$(ENV))
$(VENV)/.serve-$(ENV): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	test -f $(VENV)/.installed || \
	  $(PY) -m pip install --quiet $(if $(SERVE_EXTRA),-e '.[$(SERVE_EXTRA)]',-e .)
	touch $@

# Packaging: `build` and setuptools only (a dev venv has both), so `make dist` needs no [dev].
$(VENV)/.build-tools: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c 'import build' 2>/dev/null || \
	  $(PY) -m pip install --quiet 'build>=1.2' 'setuptools>=70.1'
	touch $@

## dist: a wheel and an sdist in dist/: the library, the catalogue envs (openenv_grpc_envs),
## the generated code; `pip install 'dist/openenv_grpc-VERSION-py3-none-any.whl[gymnasium]'`
dist: $(VENV)/.build-tools
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

$(BUF): package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	touch $@

install: $(VENV)/.installed $(BUF)

## serve: run a server with the default environment on localhost (no Docker)
serve: $(VENV)/.serve-$(ENV)
	$(VENV)/bin/openenv-grpc serve $(ENV) --host $(HOST) --port $(PORT)

## test: the whole suite: lint, generated-code drift, wire compatibility, then every test
test: system-deps lint proto-check buf-breaking pytest

## test-fast: the minutes-long loop: lint + every test that starts no server of its own
## (in-process tests, and server tests sharing one server per module or class); no
## containers, proxies, browsers, other languages, training, fuzzers or attack floods
test-fast: lint $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow and not fresh_server" $(FAST_XDIST)

## system-deps: the Debian packages the tests need (Node, Go + grpc-go, protoc, Chromium), if missing
system-deps:
	bash scripts/install_system_deps.sh

# Most tests wait on servers, but timing-bound ones flaked with 4 workers on 2 cores: 2 here
# conftest.py keeps each file (and the files sharing dockerd or the coding sandboxes) on one
# worker. TEST_WORKERS=0: serial.
# test-fast is mostly CPU (in-process tests, and each xdist worker collects the suite): 2.
TEST_WORKERS ?= 2
FAST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
FAST_XDIST := $(if $(filter 0,$(FAST_WORKERS)),,-n $(FAST_WORKERS) --dist loadgroup)
pytest: $(VENV)/.installed $(NODE_CLIENT) $(BUF)
	$(PY) -m pytest $(XDIST)

# The Node client's dependencies (exact versions from its package-lock.json).
$(NODE_CLIENT): clients/node/package.json clients/node/package-lock.json
	npm ci --prefix clients/node --no-audit --no-fund --silent
	touch $@

## console: a server with the default environment plus its web console on http://127.0.0.1:8080/
CONSOLE_PORT ?= 8080
console: $(VENV)/.installed
	$(VENV)/bin/openenv-grpc serve $(ENV) --host $(HOST) --port $(PORT) & server=$$!; \
	  trap 'kill $$server' EXIT INT TERM; \
	  $(VENV)/bin/openenv-grpc console $(HOST):$(PORT) --port $(CONSOLE_PORT)

## console-screenshot: retake the README's console screenshot (an Atari frame) with the browser test
console-screenshot: $(VENV)/.installed system-deps
	$(PY) -m pytest -q tests/test_console_browser.py -k atari
	mkdir -p docs/images
	cp build/test-artifacts/console/atari.png docs/images/console-atari.png

## clients: install what the Node client needs (the Go client builds from Debian packages)
clients: $(NODE_CLIENT)

## go-play: generate the Go stubs and build the Go player into build/gopath/bin/play
go-play:
	clients/go/generate.sh $(GOPATH_DIR)
	GOPATH="$(CURDIR)/$(GOPATH_DIR):/usr/share/gocode" GO111MODULE=off \
	  go build -o $(GOPATH_DIR)/bin/play openenvgrpc/client/play

## buf-breaking: proto/ must stay wire compatible with the previous commit
buf-breaking: $(BUF)
	scripts/buf_breaking.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	@# envs/ imports as openenv_grpc_envs only through the editable install's import hook,
	@# which mypy cannot follow: a symlink gives it the package under its import name.
	mkdir -p build/mypy && ln -sfn "$(CURDIR)/envs" build/mypy/openenv_grpc_envs
	MYPYPATH=build/mypy $(VENV)/bin/mypy --strict --exclude '_pb2' --exclude '/tests/' -p openenv_grpc_envs
	$(BUF) lint

## settings-table: rewrite docs/settings.md's server settings table from server/config.py
settings-table: $(VENV)/.installed
	$(PY) scripts/settings_table.py

## proto: regenerate Python messages, stubs and type stubs from proto/
proto: $(VENV)/.installed
	$(PY) scripts/protogen.py

proto-check: $(VENV)/.installed
	$(PY) scripts/protogen.py --check

clean:
	rm -rf $(VENV) node_modules clients/node/node_modules build dist *.egg-info

## bench-echo: step latency at 1 session and throughput at 64 (numbers go to docs/benchmarks.md)
bench-echo: $(VENV)/.installed
	$(PY) -m bench.echo_load --sessions 1 64 --seconds 5

BENCH ?= --quick
## bench-snapshots: snapshot size, snapshot + restore round trip, fork of 16, per catalogue env
bench-snapshots: $(VENV)/.installed
	$(PY) -m bench.snapshots --markdown

GYM_BENCH ?=
## bench: openenv-grpc vs OpenEnv side by side (BENCH=--full for the big run), then bench-gym
bench: $(VENV)/.installed
	$(PY) -m bench.run $(BENCH)
	$(PY) -m bench.vector_load $(BENCH)
	$(PY) -m bench.gym_vector $(GYM_BENCH)

## bench-vector: vector streams vs N sessions, bare grpc.aio and OpenEnv 0.10.0 / 0.3.0; CPU-heavy one process vs --isolated 2
bench-vector: $(VENV)/.installed
	$(PY) -m bench.vector_load $(BENCH)

## bench-gym: Gymnasium vector envs, remote (vector stream, N sessions, EnvPool) vs in process
bench-gym: $(VENV)/.installed
	$(PY) -m bench.gym_vector $(GYM_BENCH)

## image: the container image of one environment: make image ENV=echo [BASE_IMAGE=python:3.11-slim]
image:
	BASE_IMAGE=$(BASE_IMAGE) DOCKER_HOST=$${DOCKER_HOST:-$$(scripts/start_dockerd.sh | tail -n1)} \
	  deploy/docker/build_image.sh $(ENV)

## dockerd: start the private Docker daemon (host networking only); prints the DOCKER_HOST to export
dockerd:
	@scripts/start_dockerd.sh
