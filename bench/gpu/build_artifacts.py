"""Compile the artifacts the GPU tests and benchmarks load, on a machine without a GPU.

    python bench/gpu/build_artifacts.py build/gpu

- ``wide_head_float16.cuda.grape``: ``models.wide_head``, outputs of odd width on cuBLASLt
  (tests).
- ``fused_attention_{causal,bias}_d64.cuda.grape``, ``fused_attention_causal_d128.cuda.grape``:
  ``models.causal_attention`` in fp16 on grape's fused attention kernel;
  ``fused_attention_dense_d64.cuda.grape``: ``models.dense_attention`` (tests).
- ``decode_attention_{float32,float16}_d{64,128}.cuda.grape``: ``models.attention_products``
  with a mask, on grape's decode attention kernel; ``attention_products_{float32,float16}``:
  the same without a mask at a head_dim of 80, cuBLASLt's two products (tests);
  ``cached_attention_{float32,float16}_d{64,128}.cuda.grape``: ``models.cached_attention``,
  the kernel appending to the cache (tests);
  ``decode_attention{,_w4}.cubin``: the decode attention kernel, 8 and 4 warps a block
  (``bench/decode_attention.py``).
- ``library_{float32,float16}.cuda.grape``: a GPT-2 MLP whose matmuls are cuBLASLt calls
  (tests).
- ``blocks.cuda.grape``: the bundled example (tests, demo); ``blocks_4096.cuda.grape`` the
  same over n = 1..4096 (``bench/memory.py``).
- ``attention.cuda.grape``: three inputs of one shape (tests: one tensor for all three).
- ``gpt2_tiny.cuda.grape``, ``gpt2.grape.cuda.grape``: decode steps with a KV cache (tests,
  zero-copy benchmark).
- ``decoder_tiny.{loop,tvm_vm}.cuda.grape``, ``decoder{,_small}.{loop,tvm_vm}.cuda.grape``: a greedy
  decoder's step (static KV cache) compiled as a loop by ``compile_loop`` and by TVM's
  default pipeline (tests, decode-loop benchmark).
- ``affine_loop.{onnx,cuda.grape}``: an ONNX ``Loop`` with a data-dependent stop (tests).
- ``blocks24.{grape,tvm_vm,tvm_cuda_graph}.cuda.grape``: the argument-table benchmark's
  model (24 blocks, width 768, n = 1..1024; weights are inputs, made on the GPU from a seed)
  built by grape, by TVM's default pipeline, and by TVM's default pipeline with its own
  CUDA graph option (``relax.backend.use_cuda_graph``).
- ``gpt2_prefill.cuda.grape``, ``gpt2_decode.cuda.grape`` (+ ``.weights.json``): Hugging
  Face GPT-2 124M with weights as inputs (``build_hf_models``; needs torch+transformers),
  and TVM's own builds of them, ``gpt2_{prefill,decode}.{tvm_vm,tvm_cuda_graph}.cuda.grape``
  (``hf_baselines.json`` says how each was built, or why not), for ``bench/hf_models.py``;
  the same in fp16: ``gpt2_{prefill,decode}_fp16*`` (``hf_models.py --dtype float16``).
- ``decode_variants/{norm_waits_first,separate_append}.cuda.grape``: GPT-2's decode step
  with the GEMVs that compute a layer norm first waiting before their weights' loads, and
  with the caches appended by concat kernels (``bench/decode_step_variants.py``).
- ``pdl_chain``: the executable of ``bench/kernels/pdl_chain.cu`` (``bench/pdl_chain.py``),
  with grape's generated GEMV kernels of GPT-2's MLP (``pdl_chain_grape_mlp.cuh``).
- ``gemv_chain/``: chains of GEMVs at GPT-2's shapes, weights bound once, default and
  ``CHAIN_BUILDS`` builds (``bench/gemv_chain.py``).
- ``sequential_launch/{decoder.loop,gpt2_decode}.cuda.grape``: the same two built without
  programmatic dependent launch (``build(dependent_launch=False)``), which
  ``bench/decode_loop.py`` and ``bench/hf_models.py`` time beside the default builds.
- ``gemv_{kn,nk}_{float32,float16}.cuda.grape``: two matmuls with symbolic rows m = 1..1024
  (``models.gemv_test_relax``: one with bias and GELU, one with bias; weights [K, N] and
  [N, K]) on grape's GEMV kernels and dlight's Matmul above 8 rows (tests).
- ``matmul_{kn,nk}_{float32,float16}_{K}x{N}.{grape,tvm_dlight}.cuda.grape``: ``y = x @ W`` at
  GPT-2's five (K, N), m = 1..1024, built by grape's pipeline and by the same pipeline without
  its GEMV rule (TVM's dlight schedules; "kn" only) for ``bench/matmul.py``.
- ``branches.{grape,grape_host_if,tvm_vm}.cuda.grape``: ``models.branch_model`` (a
  data-dependent early exit, width 512, n = 1..1024) with its ``if`` as a conditional region,
  with its ``if`` left to the VM (regions still graphs), and TVM's build (its VM reads the
  condition on the host; TVM's pipeline with grape's schedule rules and, after TVM's memory
  planning, ``HoistBranchStorage``: without it TVM's build of this model crashes on the else
  branch); ``nested.cuda.grape``: tests/
  test_branches.py's nested branches (tests, ``bench/branches.py``).
- ``reductions.cuda.grape``: ``models.reductions_model``, means, sums, a max and a min over
  n = 0..1024 rows (tests: grape's ``FullReduction`` and dlight's ``Reduction``, empty too).
- ``tp_{llama_7b,gpt2}.{1,2}gpu.cuda.grape``: a Llama decode step at Llama-2-7B's sizes
  (fp16) and GPT-2's decode step (fp32, batch 1), each for one GPU and for two (tensor
  parallelism; weights are inputs, made on the GPUs from a seed) (``bench/tensor_parallel.py``).
- ``conv_stack_{float32,float16}.cuda.grape``: ``models.conv_stack``, a Wav2Vec2-like front
  end (strided convs, a grouped "same" conv) over 400..16000 samples, batch 1..2, its convs
  as windows and cuBLASLt matmuls (``passes/conv_matmul.py``; tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import onnx
import tvm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

from blocks import make_blocks  # noqa: E402  pylint: disable=wrong-import-position
from models import (  # noqa: E402  pylint: disable=wrong-import-position
    DECODER_BENCH,
    DECODER_SMALL,
    DECODER_TINY,
    REDUCTION_OUTPUTS,
    TENSOR_PARALLEL_MODELS,
    GPT2_MATMULS,
    UNFUSED_HEAD_DIM,
    blocks_relax,
    branch_model,
    conv_stack,
    decoder_state_names,
    decoder_step,
    gemv_chain_relax,
    gemv_test_constants,
    gemv_test_relax,
    gpt2_decode_step,
    gpt2_output_names,
    attention_products,
    cached_attention,
    causal_attention,
    dense_attention,
    library_layer,
    wide_head,
    reductions_model,
    matmul_relax,
    mlp_chain_relax,
    tensor_parallel_artifact,
    tensor_parallel_module,
)

import grape_tvm  # noqa: E402  pylint: disable=wrong-import-position
from grape_tvm.compiler import _cuda_sources, _relax_signature, package  # noqa: E402  pylint: disable=wrong-import-position
from grape_tvm.runtime.signature import ShapeRange  # noqa: E402  pylint: disable=wrong-import-position

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
BENCH_DIMS = {"n": (1, 1024)}
REDUCTION_DIMS = {"n": (0, 1024)}


def _upper_bounded(mod: tvm.IRModule, his: dict[str, int]) -> tvm.IRModule:
    """``mod`` as TVM's own pipelines take declared bounds: ``tir_var_upper_bound`` on main
    (memory planned at the bound), nothing else of grape's."""
    bounded = mod.clone()
    bounded["main"] = bounded["main"].with_attr("tir_var_upper_bound", his)
    return bounded


def _timed(label: str, fn):
    t0 = time.perf_counter()
    out = fn()
    print(f"{label}: {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def build_example(out: Path, hi: int = 256) -> None:
    """The bundled example over n = 1..``hi``: ``blocks.cuda.grape`` (tests, demo), or
    ``blocks_{hi}.cuda.grape`` for another ``hi`` (``bench/memory.py --device cuda``)."""
    model = out / "blocks.onnx"
    onnx.save(make_blocks(), str(model))
    name = "blocks.cuda.grape" if hi == 256 else f"blocks_{hi}.cuda.grape"
    module = _timed(name, lambda: grape_tvm.compile_onnx(model, dims={"n": (1, hi)},
                                                          target="cuda"))
    module.export(out / name)


def build_bench(out: Path, width: int = 768, depth: int = 24) -> None:
    mod = blocks_relax(width, depth)
    ranges = {k: ShapeRange.of(v, k) for k, v in BENCH_DIMS.items()}
    signature = _relax_signature(mod["main"], ranges, ["y"])
    grape = _timed("blocks24.grape", lambda: grape_tvm.build(mod, BENCH_DIMS, CUDA, output_names=["y"]))
    grape.export(out / "blocks24.grape.cuda.grape")
    # TVM as a TVM user runs it: its default CUDA pipeline, memory planned at the same bound.
    bounded = _upper_bounded(mod, {"n": BENCH_DIMS["n"][1]})
    vm = _timed("blocks24.tvm_vm", lambda: tvm.compile(bounded, target=CUDA))
    package(vm, signature, CUDA).export(out / "blocks24.tvm_vm.cuda.grape")
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        graph = _timed("blocks24.tvm_cuda_graph", lambda: tvm.compile(bounded, target=CUDA))
    package(graph, signature, CUDA).export(out / "blocks24.tvm_cuda_graph.cuda.grape")


def build_decode_tiny(out: Path) -> None:
    """A GPT-2 decode step with an explicit KV cache, small (tests)."""
    small = _timed("gpt2_tiny", lambda: grape_tvm.build(
        gpt2_decode_step(64, 4, 2), {"past": (1, 64)}, CUDA, output_names=gpt2_output_names(2)))
    small.export(out / "gpt2_tiny.cuda.grape")


def build_decode(out: Path) -> None:
    """A decode step at GPT-2 small's shapes (the zero-copy benchmark)."""
    full = _timed("gpt2", lambda: grape_tvm.build(
        gpt2_decode_step(768, 12, 12), {"past": (1, 1024)}, CUDA, output_names=gpt2_output_names(12)))
    full.export(out / "gpt2.grape.cuda.grape")


def build_loop_tiny(out: Path) -> None:
    build_loop(out, (("decoder_tiny", DECODER_TINY),))


def build_loop(out: Path, configs=(("decoder", DECODER_BENCH), ("decoder_small", DECODER_SMALL)),
               baselines: bool = True, dependent_launch: bool = True) -> None:
    """The decode loop: grape's ``compile_loop`` and (``baselines``) TVM's default build of
    the same step."""
    for name, config in configs:
        step = decoder_step(**config)
        carried = decoder_state_names(config["layers"])
        # the loop invariants are bound once: the build may take them in its own layout
        invariants = [p.name for p in step["main"].params if p.name not in carried]
        loop = _timed(f"{name}.loop", lambda: grape_tvm.compile_loop(
            step, carried, max_steps=config["max_len"] - 1, dims={"batch": (1, 8)}, target=CUDA,
            weights=invariants, dependent_launch=dependent_launch))
        loop.export(out / f"{name}.loop.cuda.grape")
        if not baselines:
            continue
        bounded = _upper_bounded(step, {"batch": 8})
        vm = _timed(f"{name}.tvm_vm", lambda: tvm.compile(bounded, target=CUDA))
        package(vm, loop.signature, CUDA).export(out / f"{name}.tvm_vm.cuda.grape")


HF_DIMS = {
    "gpt2_prefill": {"batch": (1, 8), "seq": (1, 1024)},
    "gpt2_decode": {"batch": (1, 8), "past": (1, 1024)},
    "wav2vec2": {"batch": (1, 1), "samples": (16000, 256000)},
}


# TVM's default CUDA pipeline crashes the process on fp16 matmuls (dlight's
# MatmulTensorization, docs/tvm_onnx_frontend.md): a crash cannot be caught, so it is not tried.
FP16_DEFAULT_PIPELINE = ("not tried: TVM 0.27's default CUDA schedules segfault on fp16 "
                         "matmuls (MatmulTensorization)")


def _tvm_baselines(onnx_path: Path, dims: dict, out: Path, name: str,
                   pipelines: tuple[str, ...] = ("default", "default+grape_schedules")) -> dict:
    """TVM as a TVM user runs the same imported module: ``tvm_vm`` (TVM's default CUDA
    pipeline, memory planned at the declared bounds) and ``tvm_cuda_graph`` (the same with
    ``relax.backend.use_cuda_graph``). Where TVM's default schedules fail on a kernel, TVM's
    pipeline with grape's tolerant schedule rules (``gpu_legalize_passes``) and named
    derived dims instead, recorded in the returned notes (also a failure, with its reason)."""
    from grape_tvm.frontend import import_onnx, load_onnx, onnx_signature  # pylint: disable=import-outside-toplevel

    proto = load_onnx(onnx_path)
    signature = onnx_signature(proto, dims)
    mod = import_onnx(proto, signature.dims)
    bounded = _upper_bounded(mod, {k: v.hi for k, v in signature.dims.items()})
    notes = {}
    for system, config in (("tvm_vm", {}), ("tvm_cuda_graph", {"relax.backend.use_cuda_graph": True})):
        note: dict = {"built": False}
        if "default" not in pipelines:
            note["default_error"] = FP16_DEFAULT_PIPELINE
        for pipeline in pipelines:
            try:
                with tvm.transform.PassContext(config=config):
                    vm = _timed(f"{name}.{system} ({pipeline})", lambda p=pipeline: tvm.compile(
                        bounded, target=CUDA,
                        relax_pipeline="default" if p == "default" else _tvm_pipeline_grape_schedules()))
                package(vm, signature, CUDA).export(out / f"{name}.{system}.cuda.grape")
                note.update(built=True, pipeline=pipeline)
                break
            except Exception as err:  # pylint: disable=broad-except
                lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
                reason = next((ln.strip() for ln in lines if "Error" in ln), lines[-1] if lines else
                              type(err).__name__)
                note[f"{pipeline}_error"] = reason[:400]
                print(f"{name}.{system} ({pipeline}) failed: {reason[:400]}", flush=True)
        notes[system] = note
    return notes


def _tvm_pipeline_grape_schedules(repair_branch_storage: bool = False):
    """TVM's CUDA pipeline (its finalize passes: ``RewriteCUDAGraph`` where configured) with
    grape's tolerant schedule rules (dlight's, not grape's GEMV rule) and named derived dims:
    no graph regions, no grape runtime.

    ``repair_branch_storage``: ``HoistBranchStorage`` right after TVM's
    ``StaticPlanBlockMemory``. TVM 0.27's planner can reuse, in an ``if``'s else branch, a
    storage it defines only in the then branch; the VM then crashes on the else branch
    (``models.branch_model``: TVM's own build of it segfaults without this;
    docs/tvm_onnx_frontend.md)."""
    from tvm import relax  # pylint: disable=import-outside-toplevel
    from tvm.relax.backend.cuda import pipeline as cuda  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes import (NameDerivedDims, after_memory_planning,  # pylint: disable=import-outside-toplevel
                                  gpu_legalize_passes)

    @tvm.transform.module_pass(opt_level=0, name="TVMWithGrapeSchedules")
    def _pipeline(mod, _ctx):
        finalize = cuda.finalize_passes(CUDA)
        if repair_branch_storage:
            finalize = after_memory_planning(finalize)
        with CUDA:
            return tvm.transform.Sequential(
                [NameDerivedDims(), relax.transform.ConvertToDataflow()]
                + cuda.library_dispatch_passes(CUDA) + gpu_legalize_passes(decode_gemv=False)
                + cuda.dataflow_lower_passes(CUDA) + finalize)(mod)

    return _pipeline


def _weight_inputs(weight_map: Path) -> list[str]:
    """The inputs a ``NAME.weights.json`` of ``bench/export_hf.py`` names: bound once."""
    return sorted(json.loads(weight_map.read_text())["inputs"])


def _compile_hf(onnx_dir: Path, name: str, base: str, dependent_launch: bool = True):
    """grape's build of ``onnx_dir/NAME.onnx`` (``base``: its entry of ``HF_DIMS``), the
    inputs its weight map names bound once."""
    return grape_tvm.compile_onnx(onnx_dir / f"{name}.onnx", dims=HF_DIMS[base], target=CUDA,
                                  weights=_weight_inputs(onnx_dir / f"{name}.weights.json"),
                                  dependent_launch=dependent_launch)


def _gpt2_decode_onnx(out: Path) -> Path:
    """``out/hf_onnx``, holding GPT-2's decode step (exported, and built, if it is not)."""
    onnx_dir = out / "hf_onnx"
    if not (onnx_dir / "gpt2_decode.onnx").exists():
        build_hf_models(out, ("gpt2_decode",), baselines=False)
    return onnx_dir


def build_hf_models(out: Path, models: tuple[str, ...] = ("gpt2_prefill", "gpt2_decode"),
                    baselines: bool = True, dtype: str = "float32",
                    dependent_launch: bool = True, onnx_dir: Path | None = None) -> None:
    """Hugging Face GPT-2 (124M, ``dtype``: NAME_fp16 for float16), weights as inputs:
    ``NAME.cuda.grape`` plus
    ``NAME.weights.json``, which ``bench/export_hf.py``'s ``hf_weights`` turns into the
    arrays to ``bind_inputs`` on the GPU host. Skipped without torch/transformers.
    Wav2Vec2 is built by ``build_wav2vec2`` (no TVM-pipeline baselines for it).

    With ``baselines``, TVM's own builds of the same imported modules for
    ``bench/hf_models.py``: ``NAME.tvm_vm.cuda.grape`` and ``NAME.tvm_cuda_graph.cuda.grape``
    (``_tvm_baselines``), and ``hf_baselines.json`` saying how each was built or why not."""
    try:
        import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        import transformers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        print("build_hf_models: torch/transformers not installed, skipped", flush=True)
        return

    from export_hf import export_all  # pylint: disable=import-outside-toplevel

    if onnx_dir is None:  # else the caller exported them there
        onnx_dir = out / "hf_onnx"
        kinds = tuple(sorted({m.split("_")[0] for m in models}))
        export_all(onnx_dir, tiny=False, embed_weights=False, models=kinds, dtype=dtype)
    suffix = "_fp16" if dtype == "float16" else ""
    notes_path = out / "hf_baselines.json"
    notes = json.loads(notes_path.read_text()) if notes_path.exists() else {}
    for base in models:
        name = base + suffix
        module = _timed(f"{name}.cuda.grape", lambda n=name, b=base: _compile_hf(
            onnx_dir, n, b, dependent_launch))
        module.export(out / f"{name}.cuda.grape")
        (out / f"{name}.weights.json").write_bytes((onnx_dir / f"{name}.weights.json").read_bytes())
        if baselines:
            pipelines = ("default+grape_schedules",) if dtype == "float16" else \
                ("default", "default+grape_schedules")
            notes[name] = _tvm_baselines(onnx_dir / f"{name}.onnx", HF_DIMS[base], out, name,
                                         pipelines)
            notes_path.write_text(json.dumps(notes, indent=1))


def build_wav2vec2(out: Path) -> None:
    """Hugging Face Wav2Vec2 base, weights as inputs, batch 1, 1 to 16 s of 16 kHz audio:
    ``wav2vec2.cuda.grape`` plus ``wav2vec2.weights.json`` (``hf_weights`` recreates the
    weights on the GPU host). Skipped without torch/transformers."""
    try:
        import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        import transformers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        print("build_wav2vec2: torch/transformers not installed, skipped", flush=True)
        return
    from export_hf import export_all  # pylint: disable=import-outside-toplevel

    onnx_dir = out / "hf_onnx"
    export_all(onnx_dir, tiny=False, embed_weights=False, models=("wav2vec2",))
    module = _timed("wav2vec2.cuda.grape", lambda: _compile_hf(onnx_dir, "wav2vec2",
                                                               "wav2vec2"))
    path = module.export(out / "wav2vec2.cuda.grape")
    (out / "wav2vec2.weights.json").write_bytes((onnx_dir / "wav2vec2.weights.json").read_bytes())
    plan = module.plan
    print(f"wav2vec2: {len(plan['regions'])} graph regions, {len(plan['host_steps'])} host steps, "
          f"{path.stat().st_size} bytes", flush=True)


def build_onnx_loop(out: Path) -> None:
    """An ONNX ``Loop`` (tests/test_onnx_loop.py's affine loop) for the GPU tests."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_onnx_loop import DIMS, affine_loop  # pylint: disable=import-outside-toplevel

    model = affine_loop()
    onnx.save(model, str(out / "affine_loop.onnx"))
    module = _timed("affine_loop", lambda: grape_tvm.compile_onnx(model, dims=DIMS, target=CUDA))
    module.export(out / "affine_loop.cuda.grape")


def build_branches(out: Path) -> None:
    """Data-dependent branches as conditional regions (tests, ``bench/branches.py``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_branches import DIMS, Nested  # pylint: disable=import-outside-toplevel

    model = branch_model(512)
    grape = _timed("branches.grape", lambda: grape_tvm.build(
        model, BENCH_DIMS, CUDA, select_ops=0, output_names=["y"]))
    grape.export(out / "branches.grape.cuda.grape")
    host = _timed("branches.grape_host_if", lambda: grape_tvm.build(
        model, BENCH_DIMS, CUDA, select_ops=0, device_branches=False, output_names=["y"]))
    host.export(out / "branches.grape_host_if.cuda.grape")
    # TVM's default CUDA schedules fail on the mean over (n, 512) (an internal check in
    # rfactor): TVM's pipeline with grape's rules (tolerant ones, and FullReduction, which
    # schedules that mean on the device) is the baseline. Its memory
    # planner leaves a storage of the else branch undefined (the VM segfaults when the else
    # branch runs): the baseline gets grape's repair of that, HoistBranchStorage, and
    # nothing else of grape's.
    vm = _timed("branches.tvm_vm", lambda: tvm.compile(
        _upper_bounded(model, {"n": 1024}), CUDA,
        relax_pipeline=_tvm_pipeline_grape_schedules(repair_branch_storage=True)))
    package(vm, grape.signature, CUDA).export(out / "branches.tvm_vm.cuda.grape")
    nested = _timed("nested", lambda: grape_tvm.build(Nested, DIMS, CUDA, output_names=["y"]))
    nested.export(out / "nested.cuda.grape")


MATMUL_DIMS = {"m": (1, 1024)}


def build_gemv_tests(out: Path) -> None:
    """Matmuls on grape's GEMV kernels, both weight layouts and constant weights, fp32 and
    fp16 (tests)."""
    for dtype in ("float32", "float16"):
        for layout in ("kn", "nk"):
            name = f"gemv_{layout}_{dtype}"
            module = _timed(name, lambda d=dtype, l=layout: grape_tvm.build(
                gemv_test_relax(d, l), MATMUL_DIMS, CUDA, output_names=["y", "z"], matmul="grape"))
            module.export(out / f"{name}.cuda.grape")
        # weights as constants, and as inputs bound once: stored [N, K], on the "nk" kernels
        # and cuBLASLt's _nt functions (the default matmul)
        name = f"gemv_constants_{dtype}"
        module = _timed(name, lambda d=dtype: grape_tvm.build(
            gemv_test_constants(d)[0], MATMUL_DIMS, CUDA, output_names=["y", "z"]))
        module.export(out / f"{name}.cuda.grape")
        name = f"gemv_weights_{dtype}"
        module = _timed(name, lambda d=dtype: grape_tvm.build(
            gemv_test_relax(d, "kn"), MATMUL_DIMS, CUDA, output_names=["y", "z"],
            weights=["w1", "b1", "w2", "b2"]))
        module.export(out / f"{name}.cuda.grape")


# bench/matmul.py's systems: what build(matmul=...) each is built with.
MATMUL_SYSTEMS = {"auto": "auto", "cublaslt": "cublaslt", "gemv": "grape", "tvm_dlight": "tvm"}


def build_matmul_bench(out: Path) -> None:
    """GPT-2's matmul shapes by every ``build(matmul=...)`` (``bench/matmul.py``)."""
    for dtype in ("float32", "float16"):
        for k, n in GPT2_MATMULS:
            for layout, systems in (("kn", ("auto", "cublaslt", "gemv", "tvm_dlight")),
                                    ("nk", ("auto", "gemv"))):
                for system in systems:
                    name = f"matmul_{layout}_{dtype}_{k}x{n}.{system}"
                    module = _timed(name, lambda d=dtype, l=layout, k=k, n=n, s=system:
                                    grape_tvm.build(matmul_relax(k, n, d, l), MATMUL_DIMS, CUDA,
                                                    output_names=["y"],
                                                    matmul=MATMUL_SYSTEMS[s]))
                    module.export(out / f"{name}.cuda.grape")


def build_attention(out: Path) -> None:
    """Three inputs of one shape, for calls that pass one tensor for all three (tests)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_executor_lifecycle import _attention_module  # pylint: disable=import-outside-toplevel

    module = _timed("attention", lambda: grape_tvm.build(
        _attention_module(), {"n": (1, 32)}, CUDA, output_names=["y", "z"]))
    module.export(out / "attention.cuda.grape")


def build_library(out: Path) -> None:
    """``models.library_layer`` and ``models.attention_products`` in fp32 and fp16: matmuls
    as cuBLASLt calls, and (``library_auto_*``) by default, grape's GEMV kernels for few
    rows (``library_auto_erf_*``: with an erf GELU; ``library_auto_norm_*``: and layer norms); ``models.wide_head`` in fp16, cuBLASLt's split calls; ``models.attention_products``
    with a mask on grape's decode attention kernel (``decode_attention_*``), and
    ``models.cached_attention`` on its kernels appending to the cache (``cached_attention_*``);
    ``models.causal_attention`` in fp16, grape's fused attention (tests)."""
    for dtype in ("float32", "float16"):
        for matmul in ("cublaslt", "auto"):
            name = f"library_{dtype}" if matmul == "cublaslt" else f"library_{matmul}_{dtype}"
            module = _timed(name, lambda d=dtype, m=matmul: grape_tvm.build(
                library_layer(d), {"n": (1, 1024)}, CUDA, output_names=["y", "h"], matmul=m))
            module.export(out / f"{name}.cuda.grape")
        # an erf GELU: fused into the GEMV kernels, a kernel after cuBLASLt's above them;
        # with layer norms too: computed by the GEMV kernels, before cuBLASLt above them
        for name, norm in ((f"library_auto_erf_{dtype}", False),
                           (f"library_auto_norm_{dtype}", True)):
            module = _timed(name, lambda d=dtype, norm=norm: grape_tvm.build(
                library_layer(d, gelu="erf", norm=norm), {"n": (1, 1024)}, CUDA,
                output_names=["y", "h"]))
            module.export(out / f"{name}.cuda.grape")
        if dtype == "float16":  # rows of odd width: cuBLASLt's split calls
            module = _timed("wide_head_float16", lambda: grape_tvm.build(
                wide_head("float16"), {"n": (1, 1024)}, CUDA, output_names=["y", "z"],
                matmul="cublaslt"))
            module.export(out / "wide_head_float16.cuda.grape")
        # A head_dim grape's decode attention kernel has not: cuBLASLt's two products.
        module = _timed(f"attention_products_{dtype}", lambda d=dtype: grape_tvm.build(
            attention_products(d, head_dim=UNFUSED_HEAD_DIM), {"b": (1, 4), "p": (1, 1024)},
            CUDA, output_names=["o"], matmul="cublaslt"))
        module.export(out / f"attention_products_{dtype}.cuda.grape")
        # grape's decode attention kernel: a mask input added, head dims 64 and 128.
        for head_dim in (64, 128):
            name = f"decode_attention_{dtype}_d{head_dim}"
            module = _timed(name, lambda d=dtype, hd=head_dim: grape_tvm.build(
                attention_products(d, head_dim=hd, mask=True), {"b": (1, 8), "p": (1, 1024)},
                CUDA, output_names=["o"]))
            module.export(out / f"{name}.cuda.grape")
            # the same, appending the step's keys and values to the cache (_append kernels)
            name = f"cached_attention_{dtype}_d{head_dim}"
            module = _timed(name, lambda d=dtype, hd=head_dim: grape_tvm.build(
                cached_attention(d, head_dim=hd), {"b": (1, 8), "p": (1, 1023)}, CUDA,
                output_names=["o", "present_k", "present_v"]))
            module.export(out / f"{name}.cuda.grape")
    # grape's fused attention kernel (passes.FuseAttention): causal and with a bias input,
    # head dims 64 and 128.
    for name, mask, heads, head_dim in (("fused_attention_causal_d64", "causal", 12, 64),
                                        ("fused_attention_bias_d64", "bias", 12, 64),
                                        ("fused_attention_causal_d128", "causal", 4, 128)):
        module = _timed(name, lambda m=mask, h=heads, d=head_dim: grape_tvm.build(
            causal_attention("float16", h, d, m), {"b": (1, 4), "s": (1, 1024)}, CUDA,
            output_names=["y"]))
        module.export(out / f"{name}.cuda.grape")
    module = _timed("fused_attention_dense_d64", lambda: grape_tvm.build(
        dense_attention("float16"), {"b": (1, 4), "s": (1, 1024)}, CUDA, output_names=["y"]))
    module.export(out / "fused_attention_dense_d64.cuda.grape")


CONV_STACK_DIMS = {"samples": (400, 16000), "b": (1, 2)}


def build_conv_stack(out: Path) -> None:
    """``models.conv_stack`` (convs as windows and cuBLASLt matmuls) in fp32 and fp16 (tests)."""
    for dtype in ("float32", "float16"):
        module = _timed(f"conv_stack_{dtype}", lambda d=dtype: grape_tvm.build(
            conv_stack(d), CONV_STACK_DIMS, CUDA, output_names=["feat", "pos"]))
        module.export(out / f"conv_stack_{dtype}.cuda.grape")


def build_reductions(out: Path) -> None:
    """Reductions over a symbolic n that may be 0 (tests)."""
    module = _timed("reductions", lambda: grape_tvm.build(
        reductions_model(512), REDUCTION_DIMS, CUDA, output_names=list(REDUCTION_OUTPUTS)))
    module.export(out / "reductions.cuda.grape")


COLLECTIVES_DIMS = {"n": (1, 256)}
COLLECTIVES_WIDTH = 64


def collectives_model() -> tvm.IRModule:
    """``y = allreduce(x @ w) + x``, ``g = allgather(y)``: a rank's collectives (as a
    tensor-parallel build's program has them) in a one-device model, for a group of one."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, COLLECTIVES_WIDTH), "float32"))
    w = relax.Var("w", relax.TensorType((COLLECTIVES_WIDTH, COLLECTIVES_WIDTH), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            summed = bb.emit(relax.op.ccl.allreduce(relax.op.matmul(x, w), "sum", in_group=False))
            y = bb.emit(relax.op.add(summed, x))
            gathered = bb.emit(relax.op.ccl.allgather(y, num_workers=1, in_group=False))
            out = bb.emit_output(relax.Tuple([y, gathered]))
        bb.emit_func_output(out)
    return bb.get()


def build_collectives(out: Path) -> None:
    """``collectives_model``: its collectives on grape's NCCL library in the graphs (tests)."""
    module = _timed("collectives", lambda: grape_tvm.build(
        collectives_model(), COLLECTIVES_DIMS, CUDA, output_names=["y", "g"]))
    module.export(out / "collectives.cuda.grape")


def build_tensor_parallel(out: Path, names=tuple(TENSOR_PARALLEL_MODELS)) -> None:
    """``tp_{llama_7b,gpt2}.{1,2}gpu.cuda.grape``: tensor parallelism's benchmark models
    (``models.TENSOR_PARALLEL_MODELS``) built for one device and, annotated Megatron's way,
    for two (``bench/tensor_parallel.py``). Their weights are inputs, made on the GPUs."""
    for name in names:
        dims = TENSOR_PARALLEL_MODELS[name]["dims"]
        for world in (1, 2):
            label = tensor_parallel_artifact(name, world)
            mod, outputs = tensor_parallel_module(name, world)
            module = _timed(label, lambda m=mod, o=outputs, w=world: grape_tvm.build(
                m, dims, CUDA, output_names=o, tensor_parallel=w))
            module.export(out / label)


def build_zoo(out: Path) -> None:
    """The zoo (``bench/zoo``) at its full size (``architectures.FULL``) for
    ``bench/zoo/gpu.py``: per model the weightless ONNX export (grape's input and
    onnxruntime's reference there), its CUDA build, and ``zoo/NAME.json``: which export it
    is and its weight map, from which the GPU host makes the weights from the config and
    seed. The first export (``Architecture.exports``) that compiles is kept. A model that
    no export compiles is left out, said here and on the GPU host."""
    sys.path.insert(0, str(ROOT / "bench" / "zoo"))
    from architectures import FULL_ARCHITECTURES  # pylint: disable=import-outside-toplevel

    zoo = out / "zoo"
    zoo.mkdir(parents=True, exist_ok=True)
    names = os.environ.get("GRAPE_ZOO_MODELS", "").split(",") if \
        os.environ.get("GRAPE_ZOO_MODELS") else list(FULL_ARCHITECTURES)
    for name in names:
        arch = FULL_ARCHITECTURES[name]
        for stale in (f"{name}.onnx", f"{name}.cuda.grape", f"{name}.json"):
            (zoo / stale).unlink(missing_ok=True)  # an earlier build's, not this one's
        for how in arch.exports:
            path = zoo / f"{name}.onnx"
            try:
                inputs = arch.export_weightless(path, how)
                module = _timed(f"zoo/{name} ({how.label()})", lambda a=arch, p=path:
                                grape_tvm.compile_onnx(p, dims=a.dims, target=CUDA))
            except Exception as err:  # pylint: disable=broad-except
                print(f"zoo/{name} ({how.label()}): {type(err).__name__}: "
                      f"{str(err).strip().splitlines()[-1][:300] if str(err).strip() else ''}")
                path.unlink(missing_ok=True)
                continue
            module.export(zoo / f"{name}.cuda.grape")
            meta = {"size": "full", "export": how.label(),
                    "attn_implementation": how.attn_implementation, "weights": inputs}
            (zoo / f"{name}.json").write_text(json.dumps(meta) + "\n")
            break
        else:
            print(f"zoo/{name}: no export compiles; left out")


def build_probe_cubins(out: Path) -> None:
    """``patch.cubin`` (``runtime/kernels/patch.cu``: ``bench/fill_kernel.py``),
    ``touch_nodes.cubin`` (``bench/kernels/touch_nodes.cu``: ``bench/device_updatable.py``) and
    ``read_floor.cubin`` (``bench/kernels/read_floor.cu``: ``bench/read_floor.py``)."""
    from grape_tvm.runtime.cuda_compile import compile_cubin  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.topology_graph import PATCH_SOURCE  # pylint: disable=import-outside-toplevel

    for name, source in (("patch", PATCH_SOURCE),
                         ("touch_nodes", ROOT / "bench" / "kernels" / "touch_nodes.cu"),
                         ("read_floor", ROOT / "bench" / "kernels" / "read_floor.cu")):
        (out / f"{name}.cubin").write_bytes(compile_cubin(source.read_text(), "sm_90"))


def build_decode_attention_cubins(out: Path) -> None:
    """``decode_attention.cubin`` (``runtime/kernels/decode_attention.cu`` as the runtime
    builds it) and ``decode_attention_w4.cubin`` (4 warps a block, 8 in its _wide kernels)
    for ``bench/decode_attention.py``."""
    from grape_tvm.runtime.attention import DECODE_SOURCE  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.cuda_compile import compile_cubin  # pylint: disable=import-outside-toplevel

    for suffix, define in (("", ""), ("_w4", "#define GRAPE_DECODE_WARPS 4\n")):
        code = define + DECODE_SOURCE.read_text()
        (out / f"decode_attention{suffix}.cubin").write_bytes(compile_cubin(code, "sm_90"))


def build_pdl_chain(out: Path) -> None:
    """``pdl_chain``: the executable of ``bench/kernels/pdl_chain.cu`` (``bench/pdl_chain.py``),
    with grape's own m = 1 GEMV kernels for GPT-2's fp32 MLP (its chain ``grape_mlp``): the
    CUDA source of a one-layer ``mlp_chain_relax`` build, written beside it and included."""
    module = grape_tvm.build(mlp_chain_relax(1), MATMUL_DIMS, CUDA, output_names=["y"],
                             weights=["w1_0", "b1_0", "w2_0", "b2_0"])
    kernels = out / "pdl_chain_grape_mlp.cuh"
    kernels.write_text("\n".join(_cuda_sources(module.executable)))
    source = ROOT / "bench" / "kernels" / "pdl_chain.cu"
    subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-std=c++17", f'-DGRAPE_KERNELS="{kernels.resolve()}"',
                    "-o", str(out / "pdl_chain"), str(source)], check=True)


def build_sequential_launch(out: Path) -> None:
    """``sequential_launch/``: the benchmarks' decoder loop and GPT-2 decode step built
    without programmatic dependent launch (each kernel launched once the one before it has
    finished), which ``bench/decode_loop.py`` and ``bench/hf_models.py`` time beside the
    default builds in the same run."""
    where = out / "sequential_launch"
    where.mkdir(parents=True, exist_ok=True)
    build_loop(where, (("decoder", DECODER_BENCH),), baselines=False, dependent_launch=False)
    build_hf_models(where, ("gpt2_decode",), baselines=False, dependent_launch=False,
                    onnx_dir=_gpt2_decode_onnx(out))


def build_decode_variants(out: Path) -> None:
    """``decode_variants/``: GPT-2's decode step (``gpt2_decode``, as ``build_hf_models``
    builds it) with the GEMVs that compute a layer norm first waiting before their weights'
    loads (``norm_waits_first``: the build before they loaded them first), and with the
    caches appended by concat kernels, not by the attention's (``separate_append``), for
    ``bench/decode_step_variants.py`` beside the default and ``sequential_launch`` builds."""
    onnx_dir = _gpt2_decode_onnx(out)
    where = out / "decode_variants"
    where.mkdir(parents=True, exist_ok=True)
    with weights_before_norm(False):
        module = _timed("decode_variants/norm_waits_first", lambda: _compile_hf(
            onnx_dir, "gpt2_decode", "gpt2_decode"))
    module.export(where / "norm_waits_first.cuda.grape")
    with cache_append_in_attention(False):
        module = _timed("decode_variants/separate_append", lambda: _compile_hf(
            onnx_dir, "gpt2_decode", "gpt2_decode"))
    module.export(where / "separate_append.cuda.grape")


def build_gemv_configs(out: Path) -> None:
    """``gemv_configs/``: grape's GEMV kernels under every tiling ``bench/gemv_configs.py``
    compares, one cubin."""
    import gemv_configs  # pylint: disable=import-outside-toplevel

    gemv_configs.build(out / "gemv_configs")


# Each chain's weights: three times the H200's L2, so that every GEMV reads its own from HBM.
CHAIN_BYTES = 150_000_000


@contextmanager
def _build_constant(module, name: str, value):
    """Builds made meanwhile with ``module.name`` set to ``value`` (None: left as it is):
    the A/B switches the passes read when they run."""
    saved = getattr(module, name)
    if value is not None:
        setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def held_weights_min_blocks(blocks: int | None):
    """Builds whose GEMV kernels that hold their weights across the wait ask for ``blocks``
    blocks an SM (0: no minimum, ptxas's default; None: grape's default)."""
    from grape_tvm.passes import dependent_launch  # pylint: disable=import-outside-toplevel

    return _build_constant(dependent_launch, "WEIGHTS_HELD_MIN_BLOCKS", blocks)


def weights_before_norm(enabled: bool):
    """Builds whose one-row GEMVs that compute a row norm first load their weights before it
    (grape's default), or wait first (``passes.gemv_schedule``'s ``WEIGHTS_BEFORE_NORM``)."""
    from grape_tvm.passes import gemv_schedule  # pylint: disable=import-outside-toplevel

    return _build_constant(gemv_schedule, "WEIGHTS_BEFORE_NORM", enabled)


def cache_append_in_attention(enabled: bool):
    """Builds whose decode attention appends the step's keys and values to the caches
    (grape's default), or leaves that to the model's concats (``passes.fused_attention``'s
    ``APPEND_TO_CACHES``)."""
    from grape_tvm.passes import fused_attention  # pylint: disable=import-outside-toplevel

    return _build_constant(fused_attention, "APPEND_TO_CACHES", enabled)


# The builds of each chain, by folder ("": the default build): (dependent launch, minimum of
# blocks an SM of a kernel holding its weights across the wait; None: grape's default).
CHAIN_BUILDS = {"": (True, None), "sequential": (False, None), "ptxas_default": (True, 0),
                "one_block": (True, 1)}


def build_gemv_chains(out: Path) -> None:
    """``gemv_chain/``: chains of grape's GEMVs (``bench/gemv_chain.py``), GPT-2 124M's four
    layer shapes and its MLP in fp32 and fp16, weights bound once, built as
    ``CHAIN_BUILDS`` says."""
    where = out / "gemv_chain"
    chains = {}
    for dtype, size in (("float32", 4), ("float16", 2)):
        for k, n in GPT2_MATMULS[:4]:
            layers = -(-CHAIN_BYTES // (k * n * size))
            chains[f"{dtype}_{k}x{n}"] = (gemv_chain_relax(k, n, layers, dtype),
                                          [f"y{i}" for i in range(layers)])
        layers = -(-CHAIN_BYTES // (2 * 768 * 3072 * size))
        chains[f"mlp_{dtype}"] = (mlp_chain_relax(layers, dtype), ["y"])
    for name, (mod, outputs) in chains.items():
        weights = [p.name for p in mod["main"].params[1:]]
        for folder, (dependent, blocks) in CHAIN_BUILDS.items():
            (where / folder).mkdir(parents=True, exist_ok=True)
            with held_weights_min_blocks(blocks):
                module = _timed(f"gemv_chain/{folder}/{name}", lambda m=mod, o=outputs, w=weights,
                                d=dependent: grape_tvm.build(m, MATMUL_DIMS, CUDA, output_names=o,
                                                             weights=w, dependent_launch=d))
            module.export(where / folder / f"{name}.cuda.grape")


# What each step of bench/gpu/run_all.sh loads, by the functions that build it.
STEPS = {
    "tests": (build_example, build_attention, build_decode_tiny, build_loop_tiny,
              build_onnx_loop, build_branches, build_reductions, build_library,
              build_gemv_tests, build_conv_stack, build_collectives),
    "demo": (build_example,),
    "inspect": (build_example,),
    "argument_tables": (build_bench,),
    "host_path": (build_bench,),
    "zero_copy": (build_decode,),
    "decode_loop": (build_loop,),
    "branches": (build_branches,),
    "memory": (lambda out: build_example(out, hi=4096),),
    "probe_cublaslt": (),
    "split_k_choices": (),
    "driver_calls": (),
    "ncu_gpt2": (build_hf_models,),
    "ncu_gpt2_prefill": (lambda out: build_hf_models(out, ("gpt2_prefill",), baselines=False,
                                                     dtype="float16"),),
    "ncu_wav2vec2": (build_wav2vec2,),
    "topology_probe": (build_library, build_probe_cubins,
                       lambda out: build_hf_models(out, ("gpt2_prefill",), baselines=False,
                                                   dtype="float16")),
    "matmul": (build_matmul_bench,),
    "hf_models": (build_hf_models, build_wav2vec2),
    "hf_models_fp16": (lambda out: build_hf_models(out, dtype="float16"),),
    "ncu_gemv": (build_matmul_bench,),
    "ncu_patch": (build_bench,),
    "read_floor": (build_probe_cubins,),
    "decode_attention": (build_decode_attention_cubins,),
    "gemv_configs": (build_gemv_configs,),
    "sequential_launch": (build_sequential_launch,),
    "pdl_chain": (build_pdl_chain,),
    "gemv_chain": (build_gemv_chains,),
    "decode_variants": (lambda out: build_hf_models(out, ("gpt2_decode",), baselines=False),
                        build_sequential_launch, build_decode_variants),
    "topology_blocks": (build_bench,),
    "loop_kernels": (build_loop,),
    "ncu_loop": (build_loop,),
    "zoo": (build_zoo,),
    "tensor_parallel": (build_tensor_parallel,),
}


def main(out: Path, steps: list[str]) -> None:
    """Build what the named steps of run_all.sh need (every step's when none is named)."""
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise SystemExit(f"unknown step(s) {unknown}: the steps are {sorted(STEPS)}")
    out.mkdir(parents=True, exist_ok=True)
    builders = []
    for step in steps or STEPS:
        builders += [b for b in STEPS[step] if b not in builders]
    for build in builders:
        build(out)
    for path in sorted(out.glob("*.grape")):
        print(f"{path}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    # build_artifacts.py [OUT] ; GRAPE_GPU_ONLY="tests demo" builds only what those steps load
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "build/gpu"),
         os.environ.get("GRAPE_GPU_ONLY", "").split())
