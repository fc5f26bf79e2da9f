"""grape's GEMV schedule rule (passes/gemv_schedule.py), on the CPU: which kernels it takes,
what it makes of them, and CUDA builds of the benchmark models that use it (nvcc where
present). The kernels run in tests/test_gpu.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tvm
from tvm import relax, s_tir, tirx

import grape_tvm
from grape_tvm.compiler import _cuda_sources
from grape_tvm.passes import CheckDeviceKernels, DecodeGemv, FuseWeightTranspose, unbound_kernels
from grape_tvm.passes.gemv_schedule import (BUCKETS, GEMV_MARK, GemvShape, accumulate_in_fp32,
                                            gemv_config, lowers_to_static_kernels, match_gemv,
                                            schedule_gemv)
from grape_tvm.runtime.cuda_compile import nvcc_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from models import blocks_relax, gpt2_decode_step, gpt2_output_names  # noqa: E402  pylint: disable=wrong-import-position

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
KERNEL = re.compile(r'__launch_bounds__\((\d+)\) (\w+)\(')


def _matmul(k: int = 64, n: int = 48, rows=("m",), dtype: str = "float32", layout: str = "kn",
            epilogue: str = "bias_gelu") -> tvm.IRModule:
    """``gelu(x @ w + b)`` (or less), x: (*rows, k); w: (k, n), or (n, k) transposed."""
    dims = [tirx.Var(r, "int64") if isinstance(r, str) else r for r in rows]
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((*dims, k), dtype))
    w = relax.Var("w", relax.TensorType((k, n) if layout == "kn" else (n, k), dtype))
    b = relax.Var("b", relax.TensorType((n,), dtype))
    op = relax.op
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = op.matmul(x, w if layout == "kn" else op.permute_dims(w, [1, 0]))
            if epilogue in ("bias", "bias_gelu"):
                y = op.add(y, b)
            if epilogue == "bias_gelu":
                y = op.nn.gelu(y)
            out = bb.emit_output(bb.emit(y))
        bb.emit_func_output(out)
    mod = bb.get()
    # [N, K] weights reach the rule as one kernel: grape's GPU pipeline fuses the transpose
    return FuseWeightTranspose()(mod) if layout == "nk" else mod


def _fused(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    t = relax.transform
    with CUDA:
        mod = tvm.transform.Sequential([t.LegalizeOps(), t.AnnotateTIROpPattern(),
                                        t.FuseOps(), t.FuseTIR()])(mod)
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _the_kernel(mod: tvm.IRModule) -> tirx.PrimFunc:
    (func,) = [f for name, f in _fused(mod).items() if "matmul" in name]
    return func


def _lowered(func: tirx.PrimFunc) -> tvm.IRModule:
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    mod = tvm.tirx.transform.BindTarget(CUDA.with_host(tvm.target.Target("llvm")))(mod)
    pipeline, _, _ = tvm.tirx.get_default_tir_pipeline(CUDA)
    return pipeline(mod)


def _kernel_body(source: str, name: str) -> str:
    """The definition of kernel ``name`` in CUDA source (not its declaration)."""
    start = re.search(r"__launch_bounds__\([\d, ]+\) " + name + r"\([^)]*\) \{", source).start()
    end = source.find('\nextern "C"', start)
    return source[start:end if end > 0 else len(source)]


def _cuda(func: tirx.PrimFunc) -> str:
    lib = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), CUDA)
    return lib.imports[0].inspect_source()


# -- what the rule takes ------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_matches_both_weight_layouts_and_dtypes(layout, dtype):
    shape = match_gemv(_the_kernel(_matmul(dtype=dtype, layout=layout)))
    assert shape is not None and shape.layout == layout and shape.dtype == dtype
    assert (shape.k, shape.n) == (64, 48) and shape.symbolic and str(shape.rows) == "m"


def test_rows_from_several_dims_of_which_one_is_symbolic():
    """[b, 1, K] @ [K, N] (a decode step with a batch): the rows are b."""
    shape = match_gemv(_the_kernel(_matmul(rows=("b", 1))))
    assert shape is not None and str(shape.rows) == "b"


@pytest.mark.parametrize("rows", [("b", "s"), (64,)], ids=["two symbolic row dims", "static 64 rows"])
def test_leaves_rows_it_is_not_for(rows):
    func = _the_kernel(_matmul(rows=rows))
    assert DecodeGemv().apply(func, CUDA, False) is None


def test_takes_a_few_static_rows_as_one_kernel():
    func = _the_kernel(_matmul(rows=(3,)))
    sch = DecodeGemv().apply(func, CUDA, False)
    assert sch is not None
    kernels = KERNEL.findall(_cuda(sch.mod["main"]))
    assert {name for _, name in kernels} == {"main_kernel"}


def test_leaves_what_is_not_a_matmul():
    bb = relax.BlockBuilder()
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 64), "float32"))
    q = relax.Var("q", relax.TensorType((4, n, 16), "float32"))
    k = relax.Var("k", relax.TensorType((4, 16, 32), "float32"))
    with bb.function("main", [x, q, k]):
        with bb.dataflow():
            s = bb.emit(relax.op.sum(x, axis=[1]))
            sm = bb.emit(relax.op.nn.softmax(x, axis=-1))
            att = bb.emit(relax.op.matmul(q, k))  # a batched matmul: a 3-D "weight"
            out = bb.emit_output(relax.Tuple([s, sm, att]))
        bb.emit_func_output(out)
    funcs = _fused(bb.get())
    assert len(funcs) >= 3
    for name, func in funcs.items():
        assert match_gemv(func) is None, name
        assert DecodeGemv().apply(func, CUDA, False) is None, name


def test_not_on_other_targets():
    func = _the_kernel(_matmul())
    assert DecodeGemv().apply(func, tvm.target.Target({"kind": "llvm"}), False) is None


# -- what it makes of them ----------------------------------------------------------------

def test_fp16_sums_in_fp32():
    """The sum is an fp32 buffer of fp32 products, cast to fp16 once (PyTorch's numerics)."""
    func = _the_kernel(_matmul(dtype="float16", epilogue="none"))
    out = accumulate_in_fp32(func, match_gemv(func).block)
    text = out.script()
    assert re.search(r'T\.sblock_alloc_buffer\(\(m, T\.int64\(48\)\)\)', text)  # fp32: no dtype
    assert 'matmul_global[v_i0, v_i1] + T.Cast("float32", x[v_i0, v_k]) * T.Cast("float32", w[v_k, v_i1])' in text
    assert 'T.Cast("float16", matmul_global[v0, v1])' in text
    assert "T.float32(0.0)" in text


def test_symbolic_rows_dispatch_on_the_host_between_bucket_kernels_and_matmul():
    func = _the_kernel(_matmul())
    sch = DecodeGemv().apply(func, CUDA, False)
    lowered = _lowered(sch.mod["main"])
    host = lowered["main"].script()
    for bound in BUCKETS:
        assert f"T.tvm_thread_invariant(m <= T.int64({bound}))" in host
    launches = re.findall(r'T\.call_ffi_kernel\("(\w+)"', host)
    assert launches == ["main_kernel", "main_kernel_1", "main_kernel_2", "main_kernel_3",
                        "main_kernel_4"]
    # no launch inside a host loop: each sits under the if-chain only
    assert not re.search(r"for .* in .*:\n(\s+.*\n)*?\s+T\.call_ffi_kernel", host)
    assert unbound_kernels(tvm.IRModule({"main": sch.mod["main"]})) == []
    CheckDeviceKernels()(tvm.IRModule({"main": sch.mod["main"]}))
    source = _cuda(sch.mod["main"])
    bounds = dict((name, int(t)) for t, name in KERNEL.findall(source))
    shape = match_gemv(func)
    assert [bounds[f"main_kernel{s}"] for s in ("", "_1", "_2", "_3")] == \
        [gemv_config(shape, rows).threads for rows in BUCKETS]
    assert bounds["main_kernel_4"] == 128  # dlight's Matmul (CUDA cores) above the buckets


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kn", [(768, 768), (3072, 768), (768, 50257), (192, 100), (97, 36)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_kernels_are_bound_vectorized_and_static(layout, dtype, kn):
    """Each bucket's kernel: every loop under blockIdx/threadIdx, one barrier between the
    partial sums and their sum, 16-byte weight loads where the contiguous axis allows,
    fp32 sums, static buffers only."""
    k, n = kn
    func = _the_kernel(_matmul(k=k, n=n, dtype=dtype, layout=layout))
    shape = match_gemv(func)
    fp32 = accumulate_in_fp32(func, shape.block) if dtype != "float32" else func
    contiguous = n if layout == "kn" else k
    vector = {"float32": "float4", "float16": "uint4"}[dtype]
    for rows in BUCKETS:
        config = gemv_config(shape, rows)
        full = 16 // (2 if dtype == "float16" else 4)  # 16-byte loads
        assert config.vec == (full if contiguous % full == 0 else 1)
        kernel = schedule_gemv(fp32, shape, config).mod["main"]
        assert lowers_to_static_kernels(kernel, CUDA)
        assert unbound_kernels(tvm.IRModule({"main": kernel})) == []
        source = _cuda(kernel)
        assert KERNEL.findall(source) == [(str(config.threads), "main_kernel")] * 2
        body = _kernel_body(source, "main_kernel")
        assert body.count("__syncthreads()") >= 1
        assert "float main" not in body  # the sums are fp32 registers / shared memory
        if config.vec > 1:
            assert f"*({vector}*)(w" in body.replace("_pad", "")
        assert config.threads_k * rows * config.cols * 4 <= 48 * 1024


@pytest.mark.parametrize("k,n,rows,per_block", [
    (1024, 256, 8, 2), (256, 256, 8, 2), (256, 768, 8, 4), (3072, 768, 8, 4), (768, 768, 8, 4),
    (256, 1024, 8, 8), (768, 2304, 8, 8), (768, 3072, 8, 8), (1024, 256, 4, 4),
    (1024, 256, 2, 2), (1024, 256, 1, 1)])
def test_a_short_grid_spreads_the_eight_row_bucket_over_blocks(k, n, rows, per_block):
    """Weights [N, K], fp32: the 8-row bucket takes 2 or 4 rows a block where its grid along
    N is short of TARGET_BLOCKS (the shapes measured in bench/results/gemv_configs.json: the
    decode-loop decoder's and GPT-2's); buckets of 4 rows and fewer keep theirs, and so do
    fp16's (not measured)."""
    shape = GemvShape("matmul", tirx.Var("m", "int64"), k, n, "nk", "float32", "float32")
    assert gemv_config(shape, rows).rows == per_block
    assert gemv_config(GemvShape("matmul", tirx.Var("m", "int64"), k, n, "nk", "float16",
                                 "float32"), rows).rows == rows
    assert gemv_config(GemvShape("matmul", tirx.Var("m", "int64"), k, n, "kn", "float32",
                                 "float32"), rows).rows == rows  # not measured: unchanged


def test_a_symbolic_local_buffer_is_refused():
    """``lowers_to_static_kernels`` catches a schedule CUDA codegen would refuse (a rule's
    mistake then leaves the kernel to the next rule instead of failing the build)."""
    func = _the_kernel(_matmul(epilogue="none"))
    sch = s_tir.Schedule(func)
    block = sch.get_sblock("matmul")
    m, n, k = sch.get_loops(block)
    tile, row = sch.split(m, [None, 8])  # rows past m: a predicate, which bounds nothing
    sch.reorder(tile, n, row, k)
    sch.bind(tile, "blockIdx.x")
    sch.bind(n, "threadIdx.x")
    local = sch.cache_write(block, 0, "local")  # min(8, m - 8 * tile) rows per thread
    sch.reverse_compute_at(local, n)
    lowered = _lowered(sch.mod["main"])
    assert any(not all(isinstance(d, tirx.IntImm) for d in a.buffer.shape)
               for a in _allocations(lowered))
    assert not lowers_to_static_kernels(sch.mod["main"], CUDA)


def _allocations(mod: tvm.IRModule) -> list:
    from tvm_ffi.structural import structural_walk  # pylint: disable=import-outside-toplevel

    found = []
    for _, func in mod.functions_items():
        structural_walk(func.body, ((tirx.AllocBuffer, found.append),))
    return found


# -- CUDA builds of the benchmark models -------------------------------------------------

def _kernels(module) -> dict[str, int]:
    return {name: int(threads) for source in _cuda_sources(module.executable)
            for threads, name in KERNEL.findall(source)}


@pytest.fixture(scope="module")
def blocks_cuda():
    return grape_tvm.build(blocks_relax(768, 2), {"n": (1, 1024)}, CUDA, output_names=["y"],
                           prebuild_cubin=nvcc_available(), matmul="grape")


def test_blocks_matmuls_dispatch_between_gemv_and_matmul(blocks_cuda):
    """``x + gelu(layer_norm(x) @ W + b)``: the matmul kernel with its bias, GELU and residual
    add is four GEMV kernels (M <= 1, 2, 4, 8) and dlight's Matmul, chosen on the host."""
    kernels = _kernels(blocks_cuda)
    name = "fused_matmul_add_gelu_add1_kernel"
    shape = GemvShape(name, tirx.Var("n", "int64"), 768, 768, "kn", "float32", "float32")
    assert [kernels.get(name + s) for s in ("", "_1", "_2", "_3")] == \
        [gemv_config(shape, rows).threads for rows in BUCKETS] == [512, 512, 512, 256]
    assert kernels[name + "_4"] == 128
    body = _kernel_body("\n".join(_cuda_sources(blocks_cuda.executable)), name)
    assert re.search(r"\*\(float4\*\)\(w0_local_ptr \+ \(ax0 \* 4\)\) = \*\(float4\*\)\(w0_ptr", body)
    assert "erff(" in body and "__shfl_down_sync" in body and "__syncthreads()" in body
    if nvcc_available():
        assert blocks_cuda.cubins  # every kernel compiled for sm_90 here


def test_blocks_dispatch_is_an_if_on_the_host():
    lowered = grape_tvm.grape_pipeline(CUDA, {"n": (1, 1024)}, matmul="grape")(blocks_relax(768, 2))
    func = lowered["fused_matmul_add_gelu_add1"]
    text = func.script()
    assert {int(r) for r in re.findall(GEMV_MARK + r'": (\d+)', text)} == set(BUCKETS)
    # n <= T.int64(1), or n <= 1 once NarrowIndices made the indices 32-bit
    assert [int(b) for b in re.findall(r"T\.tvm_thread_invariant\(n <= (?:T\.int64\()?(\d+)", text)] \
        == list(BUCKETS)
    # (the pipeline's CheckDeviceKernels has refused any kernel left unbound)


def test_gpt2_decode_step_matmuls_are_gemv_kernels():
    """Batch 1 (M = 1, static): each projection (QKV, output with the residual, MLP up with
    GELU, MLP down with the residual) is one GEMV kernel, no dispatch; attention's batched
    matmuls are not the rule's."""
    dims = {"past": (1, 1024)}
    lowered = grape_tvm.grape_pipeline(CUDA, dims, matmul="grape")(gpt2_decode_step(64, 4, 2))
    ours = {gv.name_hint: f for gv, f in lowered.functions_items()
            if isinstance(f, tirx.PrimFunc) and GEMV_MARK in f.script()}
    assert sorted(ours) == ["fused_matmul3_add1_add2", "fused_matmul4_add3_gelu",
                            "fused_matmul5_add1_add2", "fused_matmul_add"]
    assert not any("tvm_thread_invariant" in f.script() for f in ours.values())
    module = grape_tvm.build(gpt2_decode_step(64, 4, 2), dims, CUDA, matmul="grape",
                             output_names=gpt2_output_names(2), prebuild_cubin=nvcc_available())
    kernels = _kernels(module)
    for name in ours:
        assert name + "_kernel" in kernels and name + "_kernel_1" not in kernels
    assert kernels["fused_matmul5_add1_add2_kernel"] == 512  # K = 256, N = 64: 8 blocks
    if nvcc_available():
        assert module.cubins
