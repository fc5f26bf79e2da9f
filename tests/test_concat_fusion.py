"""FuseIntoConcatenations on a tiny IRModule: a decode step's cache append, the new rows
sliced and transposed out of a qkv product, becomes one kernel; built on the CPU, it equals
numpy at several past lengths."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

import grape_tvm
from grape_tvm.passes import gpu_legalize_passes, numerics_legalize_map
from grape_tvm.passes.concat_fusion import is_concatenation

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})

HEADS, HEAD_DIM = 4, 16


def _cache_append() -> tvm.IRModule:
    """present = concat(past, k) on the keys, k the heads HEADS..2 HEADS of qkv (as
    ``SplitAsSlices`` leaves GPT-2's split) transposed to [b, heads, 1, d]."""
    b, p = tirx.Var("b", "int64"), tirx.Var("past", "int64")
    width = HEADS * HEAD_DIM
    qkv = relax.Var("qkv", relax.TensorType((b, 1, 3 * width), "float32"))
    past = relax.Var("past_k", relax.TensorType((b, HEADS, p, HEAD_DIM), "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, past]):
        with bb.dataflow():
            heads = bb.emit(op.reshape(qkv, (b, 1, 3 * HEADS, HEAD_DIM)))
            k = bb.emit(op.strided_slice(heads, axes=[2], begin=[HEADS], end=[2 * HEADS]))
            k = bb.emit(op.permute_dims(k, [0, 2, 1, 3]))
            present = bb.emit_output(op.concat([past, k], axis=2))
        bb.emit_func_output(present)
    mod = bb.get()
    return tvm.IRModule({"main": mod["main"].with_attr("global_symbol", "main")})


def _fused(mod: tvm.IRModule, with_pass: bool) -> tvm.IRModule:
    """``mod`` legalized and fused as grape's GPU pipeline does, with or without the pass."""
    passes = [p for p in gpu_legalize_passes(numerics_legalize_map(gpu=True))
              if p.info.name != "ApplyDefaultSchedule" and
              (with_pass or p.info.name != "FuseIntoConcatenations")]
    with CUDA:
        return tvm.transform.Sequential(passes)(mod)


def _kernels(mod: tvm.IRModule) -> list[str]:
    return sorted(g.name_hint for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))


def test_the_new_rows_are_written_by_the_concatenation_kernel():
    """Without the pass, the slice and transpose are a kernel and the concatenation another;
    with it, one kernel (the reshape of qkv is a view either way)."""
    def kernels(with_pass):
        return [k for k in _kernels(_fused(_cache_append(), with_pass)) if k != "reshape"]

    assert kernels(False) == ["concatenate", "fused_strided_slice_transpose"]
    assert kernels(True) == ["fused_strided_slice_transpose_concatenate"]


def test_only_concatenations_are_taken():
    legalized = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                          relax.transform.AnnotateTIROpPattern()])(
        _cache_append())
    found = {g.name_hint: is_concatenation(f) for g, f in legalized.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    assert [name for name, yes in found.items() if yes] == ["concatenate"], found


def test_built_for_the_cpu_it_equals_numpy(tmp_path):
    module = grape_tvm.build(_cache_append(), {"b": (1, 2), "past": (1, 64)}, "llvm",
                             output_names=["present"])
    # one kernel: the slice and transpose of the new rows fused into the concatenation
    (kernel,) = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert "concatenate" in kernel and "strided_slice" in kernel, kernel
    executor = grape_tvm.load(module.export(tmp_path / "append.grape"))
    rng = np.random.default_rng(0)
    width = HEADS * HEAD_DIM
    try:
        for b, p in ((1, 1), (2, 7), (1, 64), (2, 33)):
            qkv = rng.standard_normal((b, 1, 3 * width)).astype("float32")
            past = rng.standard_normal((b, HEADS, p, HEAD_DIM)).astype("float32")
            got = executor.run({"qkv": qkv, "past_k": past})["present"]
            new = qkv[:, :, width:2 * width].reshape(b, 1, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
            np.testing.assert_array_equal(got, np.concatenate([past, new], axis=2))
    finally:
        executor.close()
