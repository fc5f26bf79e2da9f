#!/usr/bin/env bash
# Every GPU test and benchmark, from artifacts built on the CPU machine (`make gpu-artifacts`).
# On the GPU host, in the checkout, with build/gpu/ and .gpu-kit/ beside it:
#     bash bench/gpu/run_all.sh [OUT_DIR]
# Needs: python3 with numpy, cuda-python, onnxruntime, pytest; the runtime-only TVM kit.
set -euo pipefail
out=${1:-${OUT:-build/gpu/out}}
mkdir -p "$out"
. .gpu-kit/env.sh
site=/tmp/grape-site
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" build/gpu/grape_tvm-*.whl
export PYTHONPATH="$site:$PYTHONPATH" PYTHONUNBUFFERED=1 GRAPE_TVM_CACHE=/tmp/grape-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
python3 -P -c "import tvm, grape_tvm; print('tvm', tvm.__version__, 'grape_tvm', grape_tvm.__version__)" | tee -a "$out/machine.txt"
status=0
python3 -P -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" || status=1
python3 examples/demo.py --device cuda --artifact build/gpu/blocks.cuda.grape 2>&1 | tee "$out/demo.log" || status=1
python3 -P -m grape_tvm.cli inspect build/gpu/blocks.cuda.grape --record --device cuda 2>&1 | tee "$out/inspect.log" || status=1
python3 -P bench/argument_tables.py --artifacts build/gpu --out "$out" ${GRAPE_BENCH_ARGS:-} 2>&1 | tee "$out/argument_tables.log" || status=1
python3 -P bench/zero_copy.py --artifacts build/gpu --out "$out" ${GRAPE_ZERO_COPY_ARGS:-} 2>&1 | tee "$out/zero_copy.log" || status=1
python3 -P bench/decode_loop.py --artifacts build/gpu --out "$out" ${GRAPE_DECODE_LOOP_ARGS:-} 2>&1 | tee "$out/decode_loop.log" || status=1
exit $status
