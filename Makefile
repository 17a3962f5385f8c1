# The two commands a new user runs are `make demo` and `make test`; both set themselves up.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Test workers (pytest-xdist): two, one per core of CI's machine; 0 runs the suite in one process.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/silod/v1/*.proto)

.PHONY: demo test proto proto-release venv clean config-docs metrics-docs lab-test

# A fresh machine needs only Python 3.11 (the SDK's tests on 3.12 and 3.13 use python3.12/python3.13
# when installed, tests/client_install/test_sdk_pythons.py); everything else is installed into .venv.
# pip's output goes to a log that is shown only if the install fails.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "silod needs $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
	  echo "make demo/test need Python 3.11 ($(PYTHON) is $$($(PYTHON) -V 2>&1)): the services, the simulator"; \
	  echo "and the test tools are tested on it. The SDK alone (pip install silod) runs on 3.11-3.13."; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV): installing silod and its dependencies (log: $(VENV)/install.log)"
	@{ $(BIN)/python -m pip install --upgrade pip && $(BIN)/python -m pip install -e '.[dev]'; } \
	  > $(VENV)/install.log 2>&1 || { tail -40 $(VENV)/install.log; echo "install failed; full log: $(VENV)/install.log"; exit 1; }
	@touch $(STAMP)

venv: $(STAMP)

# Regenerate the Python code and typed stubs from protos/ into silod/v1, and docs/api.md (all committed).
proto: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iprotos \
	  --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(PROTOS)
	$(BIN)/python protos/render_api_docs.py

# Record the current protos as the released contract that `buf breaking` (tests/clients) guards.
# Run when cutting a release, never to silence a breaking-change failure.
proto-release:
	cd clients/node && npm ci --no-audit --no-fund
	cd protos && ../clients/node/node_modules/.bin/buf build -o released/silod-v1.binpb

# Regenerate docs/configuration-reference.md from the services' settings classes (committed;
# tests/deploy fail when it is stale).
config-docs: $(STAMP)
	$(BIN)/python -m services.runtime.config_reference --write

# Regenerate docs/metrics.md from the processes' metric objects (committed; tests/observability
# fails when it is stale).
metrics-docs: $(STAMP)
	$(BIN)/python -m services.runtime.metrics_reference --write

demo: $(STAMP)
	$(BIN)/python -m silod.demo

test: $(STAMP)
	@bash tests/support/ensure_debian_package.sh chromium "the dashboard's browser test" \
	  $(VENV)/chromium-install.log chromium chromium-browser google-chrome
	@bash tests/support/ensure_debian_package.sh prometheus "the metrics tests" \
	  $(VENV)/prometheus-install.log prometheus
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --max-worker-restart=0

# The namespaced multi-host lab (root): what `make test` runs of it plus the longer fault
# scenarios (30 s partitions of the control plane and of the leading scheduler's host).
# docs/operators.md "Several machines" and "High availability".
lab-test: $(STAMP)
	SILOD_LAB_FULL=1 $(BIN)/python -m pytest -q -s tests/lab

# Does silod work on this machine's GPUs? One line per check (docs/benchmarks.md "GPU check");
# without a GPU every GPU line says skipped. Flags through GPU_CHECK_ARGS (e.g. --cpu, --write-docs).
# A machine without Python 3.11 (an offline GPU image) runs benchmarks/gpu_check.sh with the
# wheels of `make gpu-wheels` carried in .gpu-wheels/.
.PHONY: gpu-check gpu-wheels
gpu-check:
	@if command -v $(PYTHON) >/dev/null || test -x $(BIN)/python; then \
	  $(MAKE) -s --no-print-directory venv && $(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS); \
	else bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS); fi

# The cp312 manylinux wheels silod needs on the offline GPU machine (benchmarks/gpu_wheels.txt),
# into .gpu-wheels/ (ignored); carry that folder there and run `bash benchmarks/gpu_check.sh`.
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_24_x86_64 -d .gpu-wheels -r benchmarks/gpu_wheels.txt

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
