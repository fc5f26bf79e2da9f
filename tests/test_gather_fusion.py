"""FuseGathers on a tiny IRModule: a decode step's embeddings (two lookups and their sum)
become one kernel; built on the CPU, they equal numpy at several batch sizes."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

import grape_tvm
from grape_tvm.passes import gpu_legalize_passes, numerics_legalize_map
from grape_tvm.passes.gather_fusion import is_gather

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
VOCAB, POSITIONS, WIDTH = 50, 12, 16


def _embeddings() -> tvm.IRModule:
    """h = wte[token] + wpe[pos]: token (b,), pos (1,), h (b, WIDTH)."""
    b = tirx.Var("b", "int64")
    token = relax.Var("token", relax.TensorType((b,), "int32"))
    pos = relax.Var("pos", relax.TensorType((1,), "int32"))
    wte = relax.Var("wte", relax.TensorType((VOCAB, WIDTH), "float32"))
    wpe = relax.Var("wpe", relax.TensorType((POSITIONS, WIDTH), "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [token, pos, wte, wpe]):
        with bb.dataflow():
            h = bb.emit_output(op.add(op.take(wte, token, axis=0), op.take(wpe, pos, axis=0)))
        bb.emit_func_output(h)
    mod = bb.get()
    return tvm.IRModule({"main": mod["main"].with_attr("global_symbol", "main")})


def _kernels(with_pass: bool) -> list[str]:
    """The kernels of ``_embeddings`` legalized and fused as grape's GPU pipeline does."""
    passes = [p for p in gpu_legalize_passes(numerics_legalize_map(gpu=True))
              if p.info.name != "ApplyDefaultSchedule" and
              (with_pass or p.info.name != "FuseGathers")]
    with CUDA:
        mod = tvm.transform.Sequential(passes)(_embeddings())
    return sorted(g.name_hint for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))


def test_the_lookups_and_their_sum_are_one_kernel():
    assert _kernels(False) == ["add", "take", "take1"]
    assert _kernels(True) == ["fused_take_take1_add"]


def test_only_gathers_are_taken():
    legalized = tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                          relax.transform.AnnotateTIROpPattern()])(_embeddings())
    found = {g.name_hint: is_gather(f) for g, f in legalized.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    assert found == {"take": True, "take1": True, "add": False}


def test_built_for_the_cpu_it_equals_numpy(tmp_path):
    module = grape_tvm.build(_embeddings(), {"b": (1, 8)}, "llvm", output_names=["h"])
    (kernel,) = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert "take" in kernel and "add" in kernel, kernel
    executor = grape_tvm.load(module.export(tmp_path / "embeddings.grape"))
    rng = np.random.default_rng(0)
    wte = rng.standard_normal((VOCAB, WIDTH)).astype("float32")
    wpe = rng.standard_normal((POSITIONS, WIDTH)).astype("float32")
    for b in (1, 3, 8):
        token = rng.integers(0, VOCAB, b).astype("int32")
        pos = np.array([rng.integers(0, POSITIONS)], "int32")
        got = executor.run({"token": token, "pos": pos, "wte": wte, "wpe": wpe})["h"]
        np.testing.assert_array_equal(got, wte[token] + wpe[pos])


def _gather_in_place() -> tvm.IRModule:
    """``buf[:4] = table[idx]`` in place (a hand-written PrimFunc through
    ``call_tir_inplace``), then ``+ 1``."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    @T.prim_func(private=True, s_tir=True)
    def gather_into(buf: T.Buffer((8, 6), "float32"), table: T.Buffer((10, 6), "float32"),
                    idx: T.Buffer((4,), "int64")):
        T.func_attr({"tirx.noalias": True})
        for i, j in T.grid(4, 6):
            with T.sblock("gather"):
                vi, vj = T.axis.remap("SS", [i, j])
                buf[vi, vj] = table[idx[vi], vj]

    buf = relax.Var("buf", relax.TensorType((8, 6), "float32"))
    table = relax.Var("table", relax.TensorType((10, 6), "float32"))
    idx = relax.Var("idx", relax.TensorType((4,), "int64"))
    bb = relax.BlockBuilder()
    gather = bb.add_func(gather_into, "gather_into")
    with bb.function("main", [buf, table, idx]):
        with bb.dataflow():
            written = bb.emit(relax.call_tir_inplace(gather, [buf, table, idx], 0,
                                                     relax.TensorType((8, 6), "float32")))
            y = bb.emit_output(relax.op.add(written, relax.const(1.0, "float32")))
        bb.emit_func_output(y)
    mod = bb.get()
    return tvm.IRModule({**dict(mod.functions),
                         mod.get_global_var("main"): mod["main"].with_attr("global_symbol", "main")})


def test_a_gather_written_in_place_keeps_its_kernel(tmp_path):
    """FuseTIR cannot fuse an in-place call with its neighbours ("Inconsistent buffers"): a
    gather called in place stays opaque, its own kernel, and the build equals numpy."""
    module = grape_tvm.build(_gather_in_place(), {}, "llvm", output_names=["y"])
    assert [k for r in module.plan["regions"] for k in r["kernels"]] == ["gather_into", "add"]
    executor = grape_tvm.load(module.export(tmp_path / "in_place.grape"))
    rng = np.random.default_rng(0)
    buf = rng.standard_normal((8, 6)).astype("float32")
    table = rng.standard_normal((10, 6)).astype("float32")
    idx = np.array([9, 0, 3, 3], "int64")
    want = buf.copy()
    want[:4] = table[idx]
    got = executor.run({"buf": buf, "table": table, "idx": idx})["y"]
    np.testing.assert_array_equal(got, want + 1)
