# grape-tvm: `make demo` runs the bundled example, `make test` runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
KIT    ?= ../shared/gpu

.PHONY: setup demo test gpu-artifacts gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,cuda,zoo]'
	touch $@

demo: setup
	$(BIN)/python examples/demo.py

test: setup
	$(BIN)/python -m pytest -q

# Build everything a GPU host needs, here (no GPU, no TVM compiler needed there):
# the grape-tvm wheel, the CUDA artifacts (cubins compiled with nvcc), the runtime-only TVM kit.
# GRAPE_GPU_ONLY="tests demo" builds only what those steps of bench/gpu/run_all.sh load.
gpu-artifacts: setup
	rm -rf build/gpu && mkdir -p build/gpu .gpu-kit
	cp $(KIT)/* .gpu-kit/
	$(BIN)/pip wheel -q --no-deps -w build/gpu .
	$(BIN)/python bench/gpu/build_artifacts.py build/gpu

# On the GPU host, after gpu-artifacts (see README, "GPU"):
gpu:
	bash bench/gpu/run_all.sh

clean:
	rm -rf build .pytest_cache examples/*.grape

# onnx's node test cases through TVM's Relax path and grape's, on CPU (20-40 minutes):
.PHONY: conformance
conformance: setup
	mkdir -p bench/results
	$(BIN)/python -m grape_tvm.conformance --json bench/results/conformance.json
