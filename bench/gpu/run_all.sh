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
# Few files come back from the GPU machine: every log goes to one, $out/run.log.
exec > >(tee "$out/run.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -P -c "import tvm, grape_tvm; print('tvm', tvm.__version__, 'grape_tvm', grape_tvm.__version__)"
# GRAPE_GPU_ONLY="tests zero_copy" runs only the steps named (device time is scarce).
want() { [ -z "${GRAPE_GPU_ONLY:-}" ] || [[ " $GRAPE_GPU_ONLY " == *" $1 "* ]]; }
status=0
want tests && { python3 -P -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu.py || status=1; }
want demo && { python3 examples/demo.py --device cuda --artifact build/gpu/blocks.cuda.grape || status=1; }
want inspect && { python3 -P -m grape_tvm.cli inspect build/gpu/blocks.cuda.grape --record --device cuda || status=1; }
want argument_tables && { python3 -P bench/argument_tables.py --artifacts build/gpu --out "$out" ${GRAPE_BENCH_ARGS:-} || status=1; }
want host_path && { python3 -P bench/host_path.py --device cuda --artifact build/gpu/blocks24.grape.cuda.grape --width 768 --out "$out" || status=1; }
want driver_calls && { python3 -P bench/driver_calls.py --out "$out" || status=1; }
# Every kernel node of GPT-2's decode step (past 256) in grape's graph, timed by ncu with
# caches flushed before each kernel (its own DRAM traffic), clocks as they are; per-shape
# graphs: ncu cannot profile device-updatable nodes. Summed by kernel: time, share of the
# step, DRAM bytes and the time over their bound at the copy bandwidth.
ncu_bin=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
want ncu_gpt2 && { "$ncu_bin" --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --cache-control all --clock-control none --csv --log-file "$out/gpt2_step_ncu.csv" python3 -P bench/kernel_profile.py build/gpu/gpt2_decode.cuda.grape --dim batch=1 --dim past=256 --weights build/gpu/gpt2_decode.weights.json --executor-steps 1 --graph-mode per-shape && python3 -P bench/kernel_profile.py --ncu-summary "$out/gpt2_step_ncu.csv" --json "$out/gpt2_step_kernels.json" --top 25 || status=1; }
# Every kernel of GPT-2's fp16 prefill at 1024 tokens, with ncu's default cache control, as
# bench/results/gpt2_prefill_kernels.*.json were measured.
want ncu_gpt2_prefill && { "$ncu_bin" --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --clock-control none --csv --log-file "$out/gpt2_prefill_ncu.csv" python3 -P bench/kernel_profile.py build/gpu/gpt2_prefill_fp16.cuda.grape --dim batch=1 --dim seq=1024 --weights build/gpu/gpt2_prefill_fp16.weights.json --executor-steps 1 --graph-mode per-shape && python3 -P bench/kernel_profile.py --ncu-summary "$out/gpt2_prefill_ncu.csv" --json "$out/gpt2_prefill_kernels.fp16_1024.json" --top 30 || status=1; }
# Every kernel of Wav2Vec2 base at 16 s of audio (256000 samples), as ncu_gpt2 (no cache flush:
# its activations are larger than L2): time, share and DRAM bytes per kernel.
want ncu_wav2vec2 && { "$ncu_bin" --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --clock-control none --csv --log-file "$out/wav2vec2_ncu.csv" python3 -P bench/kernel_profile.py build/gpu/wav2vec2.cuda.grape --dim batch=1 --dim samples=256000 --weights build/gpu/wav2vec2.weights.json --executor-steps 1 --graph-mode per-shape && python3 -P bench/kernel_profile.py --ncu-summary "$out/wav2vec2_ncu.csv" --json "$out/wav2vec2_kernels.json" --top 30 || status=1; }
# grape's GEMV kernels at M = 1 on GPT-2's shapes (weights as [K, N] and [N, K]), timed by ncu with
# caches flushed before each kernel: what they read from HBM, and how fast.
want ncu_gemv && { "$ncu_bin" --graph-profiling node --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed --clock-control none --csv --log-file "$out/gemv_ncu.csv" bash -c 'LC_ALL=C; for a in build/gpu/matmul_[kn][nk]_*.gemv.cuda.grape; do echo "== $a"; python3 -P bench/kernel_profile.py "$a" --dim m=1 --executor-steps 1 --graph-mode per-shape; done' && python3 -P bench/gemv_ncu.py "$out/gemv_ncu.csv" --copy-tbps 4.27 --out "$out" || status=1; }
# grape's decode attention kernel against PyTorch's unfused attention and SDPA (one query row,
# GPT-2's heads), with other split policies and a build of 4 warps a block beside.
want decode_attention && { python3 -P bench/decode_attention.py --cubin build/gpu/decode_attention.cubin --variant w4=build/gpu/decode_attention_w4.cubin --out "$out" || status=1; }
# grape's GEMV kernels under every tiling of bench/gemv_configs.py, against F.linear, M = 1 to 8.
want gemv_configs && { python3 -P bench/gemv_configs.py run --dir build/gpu/gemv_configs --out "$out" || status=1; }
# The same bytes read by a plain read kernel (the fastest of a sweep of grids) and by cuBLAS's
# GEMV (F.linear at M = 1), under ncu as ncu_gemv: the floor under grape's GEMVs, by size.
want read_floor && { "$ncu_bin" --metrics gpu__time_duration.sum,dram__bytes_read.sum --cache-control all --clock-control none --csv --log-file "$out/read_floor_ncu.csv" python3 -P bench/read_floor.py launch --cubin build/gpu/read_floor.cubin --out "$out" && python3 -P bench/read_floor.py summary --ncu "$out/read_floor_ncu.csv" --gemv "$out/gemv_ncu.json" --copy-tbps 4.27 --out "$out" || status=1; }
# The patch kernel of the 24-block model's graph (topology mode: ncu profiles only the patch
# nodes) at n = 1: first launch, then launches that change nothing; staged in shared memory
# (the default) and not (--patch-staged-bytes 0), one process each.
want ncu_patch && { for staged in 0 49152; do "$ncu_bin" --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv --log-file "$out/patch_ncu_staged_$staged.csv" python3 -P bench/kernel_profile.py build/gpu/blocks24.grape.cuda.grape --dim n=1 --executor-steps 5 --patch-staged-bytes "$staged" || status=1; done; }
# Why topology graphs run cuBLASLt's kernels slower than per-shape graphs (bench/README.md,
# "Session of 2026-12-02, third"): device-side updates on cuBLAS's kernels, grape_fill against
# a memset, and the library memsets of the MLP and of GPT-2's fp16 prefill, both graph modes.
want topology_probe && {
  python3 -P bench/device_updatable.py --touch-cubin build/gpu/touch_nodes.cubin --out "$out" || status=1
  python3 -P bench/fill_kernel.py --cubin build/gpu/patch.cubin --out "$out" || status=1
  for mode in topology per-shape; do
    python3 -P bench/kernel_profile.py build/gpu/library_float16.cuda.grape --dim n=128 --executor-steps 50 --graph-mode "$mode" --log-memsets || status=1
    python3 -P bench/kernel_profile.py build/gpu/gpt2_prefill_fp16.cuda.grape --dim batch=1 --dim seq=128 --weights build/gpu/gpt2_prefill_fp16.weights.json --executor-steps 20 --graph-mode "$mode" --log-memsets || status=1
  done
}
# What of a topology graph slows cuBLASLt's kernels: the head node, device-updatable nodes,
# device-side updates, or clusters (bench/topology_variants.py), at one shape.
want topology_variants && {
  python3 -P bench/topology_variants.py build/gpu/library_float16.cuda.grape --dim n=128 --out "$out" || status=1
  python3 -P bench/topology_variants.py build/gpu/gpt2_prefill_fp16.cuda.grape --dim batch=1 --dim seq=128 --weights build/gpu/gpt2_prefill_fp16.weights.json --calls 20 --out "$out" || status=1
}
# The 24-block model at n = 1 and 16: what of a topology graph costs over per-shape graphs
# (bench/topology_variants.py), and the memsets a topology graph runs as grape_fill (n = 16:
# at n = 1 grape's GEMV kernels run the matmuls, with no memset).
want topology_blocks && {
  for n in 1 16; do python3 -P bench/topology_variants.py build/gpu/blocks24.grape.cuda.grape --dim n=$n --out "$out" || status=1; done
  python3 -P bench/kernel_profile.py build/gpu/blocks24.grape.cuda.grape --dim n=16 --executor-steps 50 --log-memsets || status=1
}
# Each kernel of the decode loop's step (VM, synchronized per kernel) at batch 1 and 8: what
# grows with the batch (bench/decode_loop.py's device loop at batch 8).
want loop_kernels && { for a in decoder_small decoder; do for b in 1 8; do python3 -P bench/kernel_profile.py build/gpu/$a.loop.cuda.grape --dim batch=$b --top 12 || status=1; done; done; }
# Every kernel node of the decode loop's step in a per-shape graph, timed by ncu (caches
# flushed before each kernel), at batch 1 and 8, and the cuBLASLt algorithms chosen.
want ncu_loop && { for m in decoder decoder_small; do for b in 1 8; do "$ncu_bin" --graph-profiling node --metrics gpu__time_duration.sum --clock-control none --csv --log-file "$out/loop_ncu_${m}_$b.csv" python3 -P bench/kernel_profile.py build/gpu/$m.loop.cuda.grape --dim batch=$b --executor-steps 1 --graph-mode per-shape && python3 -P bench/kernel_profile.py --ncu-summary "$out/loop_ncu_${m}_$b.csv" --json "$out/loop_kernels_${m}_b$b.json" --top 25 || status=1; done; done; }
want zero_copy && { python3 -P bench/zero_copy.py --artifacts build/gpu --out "$out" ${GRAPE_ZERO_COPY_ARGS:-} || status=1; }
want pdl_chain && { python3 -P bench/pdl_chain.py --binary build/gpu/pdl_chain --out "$out" || status=1; }
# grape's GEMVs as a decode step runs them (chains in one graph, weights from HBM), with and
# without programmatic dependent launch, against cuBLAS on the same weights.
want gemv_chain && { python3 -P bench/gemv_chain.py --dir build/gpu/gemv_chain --out "$out" || status=1; }
# GPT-2's decode step built four ways (default, sequential_launch, decode_variants' two).
want decode_variants && { python3 -P bench/decode_step_variants.py --weights build/gpu/gpt2_decode.weights.json --variant default=build/gpu/gpt2_decode.cuda.grape --variant sequential=build/gpu/sequential_launch/gpt2_decode.cuda.grape --variant norm_waits_first=build/gpu/decode_variants/norm_waits_first.cuda.grape --variant separate_append=build/gpu/decode_variants/separate_append.cuda.grape --out "$out" || status=1; }
want decode_loop && { python3 -P bench/decode_loop.py --artifacts build/gpu --out "$out" ${GRAPE_DECODE_LOOP_ARGS:-} || status=1; }
want branches && { python3 -P bench/branches.py --artifacts build/gpu --out "$out" ${GRAPE_BRANCHES_ARGS:-} || status=1; }
want zoo && { python3 -P bench/zoo/gpu.py --artifacts build/gpu/zoo --out "$out" ${GRAPE_ZOO_ARGS:-} || status=1; }
want matmul && { python3 -P bench/matmul.py --artifacts build/gpu --out "$out" ${GRAPE_MATMUL_ARGS:-} || status=1; }
want memory && { python3 -P bench/memory.py --device cuda --artifact build/gpu/blocks_4096.cuda.grape --shapes 4096 --cycles 300 --out "$out" || status=1; }
want split_k_choices && { python3 -P bench/split_k_choices.py --out "$out" || status=1; }
want probe_cublaslt && { python3 -P bench/probe_cublaslt.py --out "$out" || status=1; }
want tensor_parallel && { python3 -P bench/tensor_parallel.py --artifacts build/gpu --out "$out" ${GRAPE_TENSOR_PARALLEL_ARGS:-} || status=1; }
want hf_models && { python3 -P bench/hf_models.py --artifacts build/gpu --out "$out" ${GRAPE_HF_MODELS_ARGS:-} || status=1; }
want hf_models_fp16 && { python3 -P bench/hf_models.py --dtype float16 --artifacts build/gpu --out "$out" ${GRAPE_HF_MODELS_ARGS:-} || status=1; }
exit $status
