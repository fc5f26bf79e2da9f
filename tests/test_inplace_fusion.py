"""FuseIntoInplaceWrites on a tiny IRModule: a static cache's new key rows, sliced out of a
qkv product and reshaped to heads, are written in place by one kernel; built on the CPU, it
equals numpy at several batches and positions."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

import grape_tvm
from grape_tvm.passes import FuseIntoInplaceWrites, gpu_legalize_passes, numerics_legalize_map

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from models import _cache_write  # noqa: E402

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
HEADS, MAX_LEN, HEAD_DIM = 2, 12, 16
WIDTH = HEADS * HEAD_DIM


def _int32_cache_write():
    """``_cache_write`` with its static dims written as Python ints (int32 in TIR), as a
    hand-written kernel may have them: FuseTIR cannot map a producer's int64 buffer onto it."""
    @T.prim_func(private=True, s_tir=True)
    def write_cache(var_cache: T.handle, var_new: T.handle, pos: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        batch = T.int64()
        cache = T.match_buffer(var_cache, (batch, HEADS, MAX_LEN, HEAD_DIM), "float32")
        new = T.match_buffer(var_new, (batch, HEADS, HEAD_DIM), "float32")
        for b, h, d in T.grid(batch, HEADS, HEAD_DIM):
            with T.sblock("write"):
                vb, vh, vd = T.axis.remap("SSS", [b, h, d])
                cache[vb, vh, T.Cast("int64", pos[0]), vd] = new[vb, vh, vd]

    return write_cache


def _key_write(writer=None, begin: int = WIDTH) -> tvm.IRModule:
    """cache[b, :, pos, :] = qkv[b, begin:begin + WIDTH] as heads, in place."""
    b = tirx.Var("b", "int64")
    qkv = relax.Var("qkv", relax.TensorType((b, 3 * WIDTH), "float32"))
    cache_type = relax.TensorType((b, HEADS, MAX_LEN, HEAD_DIM), "float32")
    cache = relax.Var("cache", cache_type)
    pos = relax.Var("pos", relax.TensorType((1,), "int32"))
    op = relax.op
    bb = relax.BlockBuilder()
    write = bb.add_func(writer or _cache_write(HEADS, MAX_LEN, HEAD_DIM), "write_cache")
    with bb.function("main", [qkv, cache, pos]):
        with bb.dataflow():
            k = bb.emit(op.reshape(op.strided_slice(qkv, axes=[1], begin=[begin],
                                                    end=[begin + WIDTH]), (b, HEADS, HEAD_DIM)))
            out = bb.emit_output(relax.call_tir_inplace(write, [cache, k, pos], 0, cache_type))
        bb.emit_func_output(out)
    mod = bb.get()
    return tvm.IRModule({**dict(mod.functions),
                         mod.get_global_var("main"): mod["main"].with_attr("global_symbol", "main")})


def _kernels(mod: tvm.IRModule, with_pass: bool) -> list[str]:
    """The PrimFuncs ``main`` calls after grape's GPU legalization and fusion."""
    passes = [p for p in gpu_legalize_passes(numerics_legalize_map(gpu=True))
              if p.info.name != "ApplyDefaultSchedule" and
              (with_pass or p.info.name != "FuseIntoInplaceWrites")]
    with CUDA:
        fused = tvm.transform.Sequential(passes)(mod)
    called = set()
    relax.analysis.post_order_visit(fused["main"], lambda e: isinstance(e, relax.GlobalVar) and
                                    called.add(e.name_hint))
    return sorted(n for n in called if isinstance(fused[n], tirx.PrimFunc))


def test_the_new_rows_are_written_by_the_kernel_that_slices_them():
    assert _kernels(_key_write(), with_pass=False) == ["reshape", "strided_slice", "write_cache"]
    (kernel,) = _kernels(_key_write(), with_pass=True)
    assert "write" in kernel


def test_a_writer_whose_dims_fusion_cannot_map_is_left_alone():
    """A writer with int32 dims: FuseTIR would fail on it (an internal error, not a skip)."""
    assert _kernels(_key_write(_int32_cache_write()), with_pass=True) == \
        ["reshape", "strided_slice", "write_cache"]


def test_only_data_movement_producers_are_taken():
    """The reshape of a symbolic batch, which TVM's pattern analysis calls opaque, moves
    data; a reduction does not."""
    from grape_tvm.passes.inplace_fusion import moves_data

    b = tirx.Var("b", "int64")
    x = relax.Var("x", relax.TensorType((b, 3 * WIDTH), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            total = bb.emit(relax.op.sum(x, axis=[1]))
            out = bb.emit_output(relax.op.reshape(relax.op.strided_slice(
                x, axes=[1], begin=[0], end=[WIDTH]), (b, HEADS, HEAD_DIM)))
        bb.emit_func_output(relax.Tuple([total, out]))
    legalized = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                          relax.transform.AnnotateTIROpPattern()])(bb.get())
    found = {g.name_hint: moves_data(f) for g, f in legalized.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    assert found == {"reshape": True, "strided_slice": True, "sum": False}, found


@pytest.mark.parametrize("begin", [0, WIDTH])
def test_built_for_the_cpu_it_equals_numpy(tmp_path, begin):
    module = grape_tvm.build(_key_write(begin=begin), {"b": (1, 4)}, "llvm",
                             output_names=["cache"])
    (kernel,) = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert "write" in kernel and "strided_slice" in kernel, kernel
    executor = grape_tvm.load(module.export(tmp_path / "write.grape"))
    rng = np.random.default_rng(begin)
    try:
        for b, pos in ((1, 0), (3, 5), (4, MAX_LEN - 1), (2, 7)):
            qkv = rng.standard_normal((b, 3 * WIDTH)).astype("float32")
            cache = rng.standard_normal((b, HEADS, MAX_LEN, HEAD_DIM)).astype("float32")
            want = cache.copy()
            want[:, :, pos, :] = qkv[:, begin:begin + WIDTH].reshape(b, HEADS, HEAD_DIM)
            got = executor.run({"qkv": qkv, "cache": cache,
                                "pos": np.array([pos], np.int32)})["cache"]
            np.testing.assert_array_equal(got, want)
    finally:
        executor.close()


def test_the_pass_alone_groups_the_chain():
    """On the legalized module: one primitive function holding the slice, the reshape and
    the write; the slice and reshape gone from ``main``."""
    legalized = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                          relax.transform.AnnotateTIROpPattern()])(_key_write())
    grouped = FuseIntoInplaceWrites()(legalized)
    relax.analysis.well_formed(grouped)
    primitive = [f for f in grouped.functions.values()
                 if isinstance(f, relax.Function) and f.attrs is not None and
                 "Primitive" in f.attrs]
    assert len(primitive) == 1
    text = grouped["main"].script()
    assert "call_tir(strided_slice" not in text and "call_tir(reshape" not in text


def _grouped(mod: tvm.IRModule) -> list[str]:
    """The primitive functions the pass makes of ``mod`` legalized."""
    legalized = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                          relax.transform.AnnotateTIROpPattern()])(mod)
    grouped = FuseIntoInplaceWrites()(legalized)
    relax.analysis.well_formed(grouped)
    return [g.name_hint for g, f in grouped.functions_items()
            if isinstance(f, relax.Function) and f.attrs is not None and "Primitive" in f.attrs]


@T.prim_func(private=True, s_tir=True)
def _double(var_x: T.handle):
    T.func_attr({"tirx.noalias": True})
    batch = T.int64()
    x = T.match_buffer(var_x, (batch, T.int64(3 * WIDTH)), "float32")
    for b, j in T.grid(batch, T.int64(3 * WIDTH)):
        with T.sblock("double"):
            vb, vj = T.axis.remap("SS", [b, j])
            x[vb, vj] = x[vb, vj] * T.float32(2)


@T.prim_func(private=True, s_tir=True)
def _shift_rows(var_cache: T.handle, var_new: T.handle):
    T.func_attr({"tirx.noalias": True})
    batch = T.int64()
    cache = T.match_buffer(var_cache, (batch, T.int64(HEADS), T.int64(MAX_LEN), T.int64(HEAD_DIM)),
                           "float32")
    new = T.match_buffer(var_new, (batch, T.int64(HEADS), T.int64(MAX_LEN - 1), T.int64(HEAD_DIM)),
                         "float32")
    for b, h, t, d in T.grid(batch, T.int64(HEADS), T.int64(MAX_LEN - 1), T.int64(HEAD_DIM)):
        with T.sblock("shift"):
            vb, vh, vt, vd = T.axis.remap("SSSS", [b, h, t, d])
            cache[vb, vh, vt + T.int64(1), vd] = new[vb, vh, vt, vd]


def test_a_source_written_in_place_before_the_write_is_read_where_it_was():
    """The slice of qkv, then qkv doubled in place, then the write: grouped, the slice would
    read qkv after the doubling (a review found it did)."""
    b = tirx.Var("b", "int64")
    qkv_type = relax.TensorType((b, 3 * WIDTH), "float32")
    cache_type = relax.TensorType((b, HEADS, MAX_LEN, HEAD_DIM), "float32")
    qkv, cache = relax.Var("qkv", qkv_type), relax.Var("cache", cache_type)
    pos = relax.Var("pos", relax.TensorType((1,), "int32"))
    bb = relax.BlockBuilder()
    write = bb.add_func(_cache_write(HEADS, MAX_LEN, HEAD_DIM), "write_cache")
    double = bb.add_func(_double, "double")
    with bb.function("main", [qkv, cache, pos]):
        with bb.dataflow():
            k = bb.emit(relax.op.reshape(relax.op.strided_slice(
                qkv, axes=[1], begin=[WIDTH], end=[2 * WIDTH]), (b, HEADS, HEAD_DIM)))
            doubled = bb.emit_output(relax.call_tir_inplace(double, [qkv], 0, qkv_type))
            out = bb.emit_output(relax.call_tir_inplace(write, [cache, k, pos], 0, cache_type))
        bb.emit_func_output(relax.Tuple([out, doubled]))
    assert _grouped(bb.get()) == []


def test_a_write_reading_what_it_writes_is_left_alone():
    """A cache's rows shifted by one, read through a slice of the cache itself: one kernel
    would read rows other threads are writing (a review found it grouped)."""
    b = tirx.Var("b", "int64")
    cache_type = relax.TensorType((b, HEADS, MAX_LEN, HEAD_DIM), "float32")
    cache = relax.Var("cache", cache_type)
    bb = relax.BlockBuilder()
    shift = bb.add_func(_shift_rows, "shift_rows")
    with bb.function("main", [cache]):
        with bb.dataflow():
            rows = bb.emit(relax.op.strided_slice(cache, axes=[2], begin=[0], end=[MAX_LEN - 1]))
            out = bb.emit_output(relax.call_tir_inplace(shift, [cache, rows], 0, cache_type))
        bb.emit_func_output(out)
    assert _grouped(bb.get()) == []
    assert len(_grouped(_key_write())) == 1  # the form it takes, for contrast
