"""``SplitAsSlices`` on tiny modules: a split read part by part becomes slices (of heads,
where a part is reshaped into heads), which fuse with their readers; results equal the
module before the pass on TVM's VM, at several shapes."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from grape_tvm.passes import SplitAsSlices


@I.ir_module
class Qkv:
    """GPT-2's attention inputs as its ONNX export has them: a split of the qkv product,
    each part reshaped into heads and transposed; v also returned as it is."""

    @R.function
    def main(x: R.Tensor(("b", "s", 192), "float32")):
        b, s = T.int64(), T.int64()
        with R.dataflow():
            qkv = R.split(x, indices_or_sections=[64, 128], axis=2)
            q = R.permute_dims(R.reshape(qkv[0], R.shape([b, s, 4, 16])), [0, 2, 1, 3])
            k = R.permute_dims(R.reshape(qkv[1], R.shape([b, s, 4, 16])), [0, 2, 1, 3])
            scores = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))
            v = qkv[2]
            R.output(scores, v)
        return (scores, v)


@I.ir_module
class WholeTuple:
    @R.function
    def main(x: R.Tensor(("n", 6), "float32")):
        with R.dataflow():
            parts = R.split(x, indices_or_sections=3, axis=1)
            first = R.add(parts[0], parts[1])
            R.output(parts, first)
        return (parts, first)


def _ops(mod) -> list[str]:
    found = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e.op.name) if isinstance(e, relax.Call) and
        hasattr(e.op, "name") else None)
    return found


def _run(mod, *args):
    exe = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(exe, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in args))
    return [o.numpy() for o in out] if not hasattr(out, "numpy") else [out.numpy()]


def test_a_split_read_part_by_part_becomes_slices_of_heads():
    after = SplitAsSlices()(Qkv)
    ops = _ops(after)
    assert "relax.split" not in ops
    assert ops.count("relax.strided_slice") == 3
    # q and k: the slice is of heads, after a reshape of x (a view), and fuses with the
    # transpose; v, returned flat, a slice of x's last axis
    text = after.script()
    assert "R.reshape(x, R.shape([b, s, 12, 16]))" in text
    assert "(2,), (0,), (4,)" in text and "(2,), (4,), (8,)" in text
    assert "(2,), (128,), (192,)" in text
    fused = relax.transform.FuseTIR()(relax.transform.FuseOps()(
        relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(after))))
    names = [g.name_hint for g in fused.functions if "strided_slice" in g.name_hint]
    assert any("transpose" in n for n in names), names
    rng = np.random.default_rng(0)
    for b, s in ((1, 1), (2, 7), (1, 33)):
        x = rng.standard_normal((b, s, 192)).astype("float32")
        for got, want in zip(_run(after, x), _run(Qkv, x)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_split_whose_tuple_is_read_whole_stays():
    """The tuple is an output: slicing the parts read one by one would write them twice."""
    after = SplitAsSlices()(WholeTuple)
    assert after.same_as(WholeTuple)


@pytest.mark.parametrize("sections", [2, 3])
def test_sections_of_a_static_axis(sections):
    bb = relax.BlockBuilder()
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, sections, axis=1))
            out = bb.emit_output(relax.op.multiply(relax.TupleGetItem(parts, 0),
                                                   relax.TupleGetItem(parts, sections - 1)))
        bb.emit_func_output(out)
    before = bb.get()
    after = SplitAsSlices()(before)
    assert "relax.split" not in _ops(after)
    x = np.arange(5 * 12, dtype="float32").reshape(5, 12)
    np.testing.assert_array_equal(_run(after, x)[0], _run(before, x)[0])


def _split_module(shape, indices, axis):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, indices, axis=axis))
            out = bb.emit_output(relax.op.add(relax.TupleGetItem(parts, 1),
                                              relax.TupleGetItem(parts, 1)))
        bb.emit_func_output(out)
    return bb.get()


def test_a_negative_axis_slices_the_same_axis():
    n = tvm.tirx.Var("n", "int64")
    before = _split_module((n, 12), [4, 8], -1)
    after = SplitAsSlices()(before)
    assert "relax.split" not in _ops(after)
    x = np.arange(3 * 12, dtype="float32").reshape(3, 12)
    np.testing.assert_array_equal(_run(after, x)[0], _run(before, x)[0])


def test_cuts_on_an_axis_that_may_be_shorter_stay_a_split():
    """split(x: (n, 3), [4], axis=0)[1] is (max(n - 4, 0), 3): a slice assumed in bounds
    from 4 would read before its start at n < 4."""
    n = tvm.tirx.Var("n", "int64")
    symbolic = _split_module((n, 3), [4], 0)
    assert SplitAsSlices()(symbolic).same_as(symbolic)
    past_the_end = _split_module((3, 6), [4], 0)
    assert SplitAsSlices()(past_the_end).same_as(past_the_end)


def test_parts_not_reshaped_into_heads_stay_slices():
    """A head size that does not divide the part's start, a reshape not into heads, and an
    export's own slice (no split) keep their reshape of the part."""
    b = tvm.tirx.Var("b", "int64")

    def module(cuts, heads_shape, split=True):
        x = relax.Var("x", relax.TensorType((b, 192), "float32"))
        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            with bb.dataflow():
                if split:
                    part = relax.TupleGetItem(bb.emit(relax.op.split(x, cuts, axis=1)), 1)
                else:
                    part = relax.op.strided_slice(x, [1], [cuts[0]], [cuts[1]])
                out = bb.emit_output(relax.op.reshape(bb.emit(part), heads_shape))
            bb.emit_func_output(out)
        return bb.get()

    heads = SplitAsSlices()(module([64, 128], (b, 4, 16)))
    assert "R.reshape(x, R.shape([b, 12, 16]))" in heads.script()
    for cuts, shape in (([8, 72], (b, 4, 16)), ([64, 128], (b, 64))):
        after = SplitAsSlices()(module(cuts, shape))
        assert "relax.split" not in _ops(after)
        assert "R.reshape(x" not in after.script()  # the part itself reshaped
    own = module([64, 128], (b, 4, 16), split=False)
    assert SplitAsSlices()(own).same_as(own)
