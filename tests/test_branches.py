"""Data-dependent branches as conditional regions (``BranchesToConditionalRegions``).

The pass on tiny IRModules, then whole programs on the CPU replay against TVM's VM (which
reads every condition on the host): both branches, nested branches, a branch whose result
is the model's output, an ONNX ``If`` against onnxruntime, and what ``inspect`` reports.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from grape_tvm import build, compile_onnx, load
from grape_tvm.passes import (CONDITIONAL_ATTR, BranchesToConditionalRegions, CopyPassThroughBranches,
                              DescribeConditionals,
                              InlineBranches, LiftGraphRegions, OutlineBranches, graph_plan)
from grape_tvm.passes.branch_fusion import BRANCH_FUNC_ATTR
from grape_tvm.passes.branch_regions import HOST_BRANCHES_ATTR
from grape_tvm.pipeline import grape_pipeline
from grape_tvm.runtime import GraphExecutor
from test_passes import _Branchy as Branchy  # x @ w, then relu or square on cond, then + x

LLVM = tvm.target.Target({"kind": "llvm"})
DIMS = {"n": (1, 32)}


def fresh(mod: tvm.IRModule) -> tvm.IRModule:
    return tvm.IRModule(dict(mod.functions))


@I.ir_module
class Nested:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32"),
             c1: R.Tensor((), "bool"), c2: R.Tensor((), "bool")):
        h = R.matmul(x, w)
        if c1:
            a = R.nn.relu(h)
            if c2:
                r1 = R.multiply(a, a)
            else:
                r1 = R.add(a, h)
            r = R.tanh(r1)
        else:
            r = R.subtract(h, x)
        y = R.add(r, x)
        return y


@I.ir_module
class ResultIsOutput:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), cond: R.Tensor((), "bool")):
        h = R.multiply(x, x)
        if cond:
            r = R.nn.relu(h)
        else:
            r = R.negative(h)
        return r


@I.ir_module
class PassThrough:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), cond: R.Tensor((), "bool")):
        h = R.multiply(x, x)
        if cond:
            r = R.nn.relu(h)
        else:
            r = h
        y = R.add(r, x)
        return y


def lowered(mod: tvm.IRModule) -> tvm.IRModule:
    return grape_pipeline(LLVM, DIMS, select_ops=0)(fresh(mod))


def bindings(expr) -> list[relax.Binding]:
    """The bindings of a function's body or of a branch."""
    seq = expr.body if isinstance(expr, relax.Function) else expr
    return [b for block in seq.blocks for b in block.bindings]


def conditionals(mod: tvm.IRModule) -> dict[str, relax.Function]:
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and f.attrs is not None and CONDITIONAL_ATTR in f.attrs}


# -- the pass ----------------------------------------------------------------------------

def _planned(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` lowered up to memory planning, where the pass runs."""
    seq = [relax.transform.LegalizeOps(), relax.transform.ToNonDataflow(),
           relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory()]
    return tvm.transform.Sequential(seq)(fresh(mod))


def test_branch_becomes_a_call_of_a_conditional_region():
    out = BranchesToConditionalRegions()(_planned(Branchy))
    main = out["main"]
    assert not any(isinstance(b.value, relax.If) for b in bindings(main))
    (name, func), = conditionals(out).items()
    assert name == "grape_cond_0"
    # The caller allocates the result, and passes it with the condition first, shape last.
    call = next(b.value for b in bindings(main) if isinstance(b.value, relax.Call)
                and isinstance(b.value.op, relax.GlobalVar) and b.value.op.name_hint == name)
    assert call.args[0].name == "cond"
    assert [str(v) for v in call.args[-1].values] == ["n"]
    r = next(b for b in bindings(main) if b.var.name == "r")
    assert r.value.op.name == "relax.builtin.alloc_tensor"
    # The conditional keeps the if; each branch writes the caller's buffer, allocates nothing.
    (branch_if,) = [b.value for b in bindings(func)]
    for side in (branch_if.true_branch, branch_if.false_branch):
        ops = [b.value.op for b in bindings(side)]
        assert len(ops) == 1 and isinstance(ops[0], relax.GlobalVar)
        assert any(a.same_as(func.params[2]) for a in bindings(side)[0].value.args)


def test_branch_returning_an_input_stays_on_the_host_with_its_reason():
    out = BranchesToConditionalRegions()(_planned(PassThrough))
    assert conditionals(out) == {}
    assert any(isinstance(b.value, relax.If) for b in bindings(out["main"]))
    reasons = dict(out["main"].attrs[HOST_BRANCHES_ATTR])
    assert "else branch returns" in reasons["r"] and "copy" in reasons["r"]


def test_nested_branches_convert_inside_out():
    out = BranchesToConditionalRegions()(_planned(Nested))
    assert sorted(conditionals(out)) == ["grape_cond_0", "grape_cond_1"]
    inner, outer = out["grape_cond_0"], out["grape_cond_1"]
    then_calls = [b.value.op.name_hint for b in bindings(bindings(outer)[0].value.true_branch)]
    assert "grape_cond_0" in then_calls  # the inner conditional is work of the outer one
    assert not any(isinstance(b.value, relax.If) for b in bindings(bindings(inner)[0].value.true_branch))


def test_describe_conditionals_names_parameters_and_dims():
    mod = BranchesToConditionalRegions()(_planned(Branchy))
    mod = DescribeConditionals()(LiftGraphRegions()(mod))
    described = json.loads(str(mod["grape_cond_0"].attrs["grape.branches"]))
    func = mod["grape_cond_0"]
    assert described["dims"] == ["n"]
    for calls in described["branches"]:
        (call,) = calls
        assert call["kind"] == "region" and call["dims"] == [0]
        region = mod[call["callee"]]
        # The region's parameters are the conditional's, in the order described.
        params = [func.params[i] for i in call["args"]]
        assert [str(p.ty) for p in params] == [str(p.ty) for p in region.params[:-1]]


def test_graph_plan_reports_conditionals_and_no_host_step():
    plan = graph_plan(lowered(Nested))
    assert plan.host_steps == []
    names = {c.name: c for c in plan.conditionals}
    assert set(names) == {"grape_cond_0", "grape_cond_1"}
    outer = names["grape_cond_1"]
    assert outer.condition == "c1" and "grape_cond_0" in outer.then_calls
    assert "predicated" in outer.mode
    assert outer.kernels == sum(len(r.kernels) for r in plan.regions if r.name in
                                outer.then_calls + outer.else_calls) + names["grape_cond_0"].kernels


@I.ir_module
class ShapeDependsOnBranch:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), cond: R.Tensor((), "bool")):
        h = R.multiply(x, x)
        if cond:
            r = R.nn.relu(h)
        else:
            r = R.strided_slice(h, axes=[0], begin=[0], end=[1])
        return r


def test_host_branch_reason_reaches_the_plan():
    plan = graph_plan(lowered(ShapeDependsOnBranch))
    (step,) = plan.host_steps
    assert step.op == "if" and "not tensors of known shape" in step.reason
    assert "launch 2 kernel(s)" in step.reason  # still graph regions, driven by the VM


def test_pass_through_branch_is_copied_and_becomes_conditional(tmp_path):
    copied = CopyPassThroughBranches()(fresh(PassThrough))
    (branch_if,) = [b.value for b in bindings(copied["main"]) if isinstance(b.value, relax.If)]
    (copy,) = bindings(branch_if.false_branch)[-1:]
    assert copy.value.op.name == "relax.astype" and copy.value.args[0].name == "h"
    executor = load(_artifact(PassThrough, tmp_path, select_ops=0), "cpu")
    assert executor.manifest["plan"]["host_steps"] == []
    vm = _vm(PassThrough)
    rng = np.random.default_rng(10)
    for n, cond in [(2, False), (2, True), (2, False), (7, True)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        _check(executor, vm, {"x": x, "cond": np.array(cond)}, ["x", "cond"])


# -- fusion inside branches ---------------------------------------------------------------

def test_outline_branches_moves_each_branch_into_a_function():
    out = OutlineBranches()(relax.transform.ConvertToDataflow()(fresh(Nested)))
    outlined = {gv.name_hint: f for gv, f in out.functions.items()
                if f.attrs is not None and BRANCH_FUNC_ATTR in f.attrs}
    assert len(outlined) == 4  # both sides of the outer if and of the nested one
    (branch_if,) = [b.value for b in bindings(out["main"]) if isinstance(b.value, relax.If)]
    for side in (branch_if.true_branch, branch_if.false_branch):
        (call,) = bindings(side)
        assert call.value.op.name_hint in outlined


@I.ir_module
class DerivedDimBranch:
    """The branches read a tensor of a derived dim, ``n * m // 16``: no parameter of an
    outlined branch defines ``n`` or ``m``."""

    @R.function
    def main(x: R.Tensor(("n", "m"), "float32"), cond: R.Tensor((), "bool")):
        n = T.int64()
        m = T.int64()
        h = R.reshape(x, R.shape([n * m // 16, 16]))
        if cond:
            r = R.nn.relu(h)
        else:
            r = R.negative(h)
        return r


def test_outlined_branch_takes_the_dims_its_parameters_do_not_define(tmp_path):
    out = OutlineBranches()(relax.transform.ConvertToDataflow()(fresh(DerivedDimBranch)))
    for gvar, func in out.functions.items():
        if func.attrs is not None and BRANCH_FUNC_ATTR in func.attrs:
            assert list(relax.analysis.free_symbolic_vars(func)) == [], gvar.name_hint
    dims = {"n": (1, 8), "m": (1, 16)}
    executor = load(build(fresh(DerivedDimBranch), dims, "llvm", select_ops=0)
                    .export(tmp_path / "d.grape"), "cpu")
    vm = _vm(DerivedDimBranch)
    rng = np.random.default_rng(15)
    for shape in ((2, 8), (4, 4), (3, 16)):
        x = rng.standard_normal(shape).astype(np.float32)
        for cond in (True, False):
            _check(executor, vm, {"x": x, "cond": np.array(cond)}, ["x", "cond"])


@pytest.mark.parametrize("c1,c2", [(True, True), (True, False), (False, True)])
def test_outline_then_inline_computes_the_same(c1, c2):
    mod = relax.transform.ConvertToDataflow()(fresh(Nested))
    back = InlineBranches()(OutlineBranches()(mod))
    assert not any(f.attrs is not None and BRANCH_FUNC_ATTR in f.attrs for f in back.functions.values())
    rng = np.random.default_rng(8)
    args = [rng.standard_normal((5, 16)).astype(np.float32),
            rng.standard_normal((16, 16)).astype(np.float32), np.array(c1), np.array(c2)]
    want = _vm(Nested)["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    got = _vm(back)["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_branches_are_fused():
    import sys  # pylint: disable=import-outside-toplevel
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from models import branch_model  # pylint: disable=import-outside-toplevel

    # TVM's fusion alone leaves the branches unfused: matmul and gelu three times, then
    # matmul and relu (one kernel per operator).
    seq = [relax.transform.ConvertToDataflow(), relax.transform.LegalizeOps(),
           relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
           relax.transform.FuseTIR()]
    plain = tvm.transform.Sequential(seq)(branch_model(64))
    (plain_if,) = [b.value for b in bindings(plain["main"]) if isinstance(b.value, relax.If)]
    assert [len([b for b in bindings(side) if isinstance(b.value, relax.Call)
                 and b.value.op.name == "relax.call_tir"])
            for side in (plain_if.true_branch, plain_if.false_branch)] == [6, 2]
    plan = graph_plan(lowered(branch_model(64)))
    regions = {r.name: r.kernels for r in plan.regions}
    (conditional,) = plan.conditionals
    assert [k for c in conditional.then_calls for k in regions[c]] == ["fused_matmul_gelu"] * 3
    assert [k for c in conditional.else_calls for k in regions[c]] == ["fused_matmul_relu"]


# -- whole programs on the CPU replay -----------------------------------------------------

def _vm(mod: tvm.IRModule):
    return relax.VirtualMachine(tvm.compile(fresh(mod), "llvm"), tvm.cpu())


def _artifact(mod, tmp_path, **kwargs):
    return build(fresh(mod), DIMS, "llvm", **kwargs).export(tmp_path / "m.grape")


def _check(executor, vm, inputs: dict, names: list[str]) -> np.ndarray:
    got = executor.run(inputs)
    want = vm["main"](*[tvm.runtime.tensor(inputs[k]) for k in names]).numpy()
    (value,) = got.values()
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-5)
    return value


def test_both_branches_equal_the_vm_across_shapes(tmp_path):
    executor = load(_artifact(Branchy, tmp_path, select_ops=0), "cpu")
    vm = _vm(Branchy)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    paths = []
    for n, cond in [(3, True), (3, False), (3, True), (17, False), (17, True), (1, True), (1, False)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        _check(executor, vm, {"x": x, "w": w, "cond": np.array(cond)}, ["x", "w", "cond"])
        paths.append(executor.stats.last["path"])
    # Every call runs from the call program, the first at new dims too (both branches are
    # recorded before it launches them, guarded): never a host read of the condition.
    assert paths == ["planned"] * 7
    assert executor.stats.host_branch_reads == 0


def test_nested_branches_take_all_three_paths(tmp_path):
    executor = load(_artifact(Nested, tmp_path), "cpu")  # default select rule: nested ifs stay
    assert len(executor.manifest["plan"]["conditionals"]) == 2
    vm = _vm(Nested)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    for n in (4, 9):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        for c1, c2 in [(True, True), (True, False), (False, True), (False, False), (True, True)]:
            _check(executor, vm, {"x": x, "w": w, "c1": np.array(c1), "c2": np.array(c2)},
                   ["x", "w", "c1", "c2"])
        assert executor.stats.last["path"] == "planned"


def test_recording_the_branch_not_taken_has_no_effect(tmp_path):
    """The branch result is the output: recording the other branch after the VM's call
    must not run it, or it would overwrite the output the caller gets."""
    executor = load(_artifact(ResultIsOutput, tmp_path, select_ops=0), "cpu")
    vm = _vm(ResultIsOutput)
    rng = np.random.default_rng(2)
    for n, cond in [(6, True), (6, False), (6, True), (11, False), (11, True)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        value = _check(executor, vm, {"x": x, "cond": np.array(cond)}, ["x", "cond"])
        assert (value >= 0).all() if cond else (value <= 0).all()


def test_onnx_if_equals_onnxruntime(models, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = compile_onnx(models["if"], {"n": (1, 32)}, "llvm", select_ops=0).export(tmp_path / "if.grape")
    executor = load(path, "cpu")
    assert executor.manifest["plan"]["host_steps"] == []
    session = ort.InferenceSession(str(models["if"]), providers=["CPUExecutionProvider"])
    w = _weights(models["if"])
    rng = np.random.default_rng(3)
    taken = set()
    for n in (1, 5, 5, 12, 5, 12, 30):
        x = rng.standard_normal((n, 8)).astype(np.float32)
        want = session.run(None, {"x": x})[0]
        got = executor.run({"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        taken.add(bool((x @ w).sum() > 0))
    assert taken == {True, False}  # both branches ran
    assert executor.stats.planned_calls >= 3  # repeated dims: both branches on the plan


def _weights(path) -> np.ndarray:
    import onnx  # pylint: disable=import-outside-toplevel
    from onnx import numpy_helper  # pylint: disable=import-outside-toplevel

    return next(numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer
                if t.name == "w")


@I.ir_module
class BranchyStep:
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), k: R.Tensor((1,), "int32")):
        s = R.sum(x)
        c = R.greater(s, R.const(0.0, "float32"))
        if c:
            y = R.subtract(R.multiply(x, R.const(0.5, "float32")), R.const(1.0, "float32"))
        else:
            y = R.add(x, R.const(0.75, "float32"))
        k2 = R.add(k, R.const(1, "int32"))
        stop = R.greater_equal(k2, R.const(9, "int32"))
        return (y, k2, stop)


def _numpy_loop(x: np.ndarray, steps: int) -> np.ndarray:
    for _ in range(steps):
        x = x * np.float32(0.5) - np.float32(1.0) if x.sum() > 0 else x + np.float32(0.75)
    return x


def test_loop_whose_step_branches_runs_as_a_host_loop(tmp_path):
    import grape_tvm  # pylint: disable=import-outside-toplevel

    module = grape_tvm.compile_loop(fresh(BranchyStep), ["x", "k"], max_steps=50,
                                    dims={"n": (1, 16)}, target="llvm", select_ops=0)
    path = module.export(tmp_path / "step.grape")
    with pytest.raises(ValueError, match="data-dependent branches"):
        grape_tvm.load_loop(path, "cpu", mode="device")
    loop = grape_tvm.load_loop(path, "cpu")
    assert loop.mode == "host" and loop.executor.manifest["plan"]["conditionals"]
    rng = np.random.default_rng(4)
    for n in (3, 16, 3):
        x = (rng.standard_normal((n, 8)) + 0.3).astype(np.float32)
        result = loop.run({"x": x, "k": np.zeros(1, np.int32)})
        assert result.steps == 9
        np.testing.assert_allclose(result.state["x"].numpy() if hasattr(result.state["x"], "numpy")
                                   else result.state["x"], _numpy_loop(x, 9), rtol=1e-5, atol=1e-5)
    loop.close()


def test_branches_left_to_the_vm_run_their_regions_as_graphs(tmp_path):
    """``device_branches=False``: the VM reads the condition (a host step, reported), and
    each branch's kernels still replay as a recorded region."""
    module = build(fresh(Branchy), DIMS, "llvm", select_ops=0, device_branches=False)
    (step,) = module.plan["host_steps"]
    assert step["op"] == "if" and "launch 2 kernel(s)" in step["reason"]
    executor = load(module.export(tmp_path / "host_if.grape"), "cpu")
    vm = _vm(Branchy)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    for n, cond in [(5, True), (5, False), (5, True), (8, False)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        _check(executor, vm, {"x": x, "w": w, "cond": np.array(cond)}, ["x", "w", "cond"])
        assert executor.stats.last["path"] == "vm"
    assert executor.stats.region_replays > 0


@I.ir_module
class TupleResult:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), cond: R.Tensor((), "bool")):
        h = R.multiply(x, x)
        if cond:
            a = R.nn.relu(h)
            b = R.sum(h, axis=[1])
            r = (a, b)
        else:
            a2 = R.negative(h)
            b2 = R.max(h, axis=[1])
            r = (a2, b2)
        y = R.add(r[0], x)
        z = R.multiply(r[1], R.const(2.0, "float32"))
        return (y, z)


def test_tuple_result_becomes_a_conditional_region(tmp_path):
    module = build(fresh(TupleResult), DIMS, "llvm", select_ops=0)
    assert module.plan["host_steps"] == [] and len(module.plan["conditionals"]) == 1
    executor = load(module.export(tmp_path / "tuple.grape"), "cpu")
    vm = _vm(TupleResult)
    rng = np.random.default_rng(9)
    for n, cond in [(4, True), (4, False), (4, True), (13, False), (13, True)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        got = list(executor.run({"x": x, "cond": np.array(cond)}).values())
        want = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(cond)))
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)
    assert executor.stats.last["path"] == "planned"


def _onnx_if_between_layers():
    """MatMul-Add-Relu, an ``If`` on the mean before the relu (sigmoid of a layer, or the
    negation), then
    MatMul-Add-Tanh: fusable work on both sides of the branch and inside it."""
    from onnx import TensorProto, helper, numpy_helper  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    consts = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w"),
              numpy_helper.from_array(rng.standard_normal((8,)).astype(np.float32), "b"),
              numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    info = helper.make_tensor_value_info
    node = helper.make_node
    then_g = helper.make_graph([node("MatMul", ["h", "w"], ["t0"]), node("Add", ["t0", "b"], ["t1"]),
                                node("Sigmoid", ["t1"], ["t"])],
                               "then", [], [info("t", TensorProto.FLOAT, ["n", 8])])
    else_g = helper.make_graph([node("Neg", ["h"], ["e"])], "else", [],
                               [info("e", TensorProto.FLOAT, ["n", 8])])
    nodes = [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Relu", ["a"], ["h"]),
             node("ReduceMean", ["a"], ["s"], keepdims=0), node("Greater", ["s", "zero"], ["c"]),
             node("If", ["c"], ["y0"], then_branch=then_g, else_branch=else_g),
             node("MatMul", ["y0", "w"], ["y1"]), node("Add", ["y1", "b"], ["y2"]), node("Tanh", ["y2"], ["y"])]
    graph = helper.make_graph(nodes, "if_between_layers", [info("x", TensorProto.FLOAT, ["n", 8])],
                              [info("y", TensorProto.FLOAT, ["n", 8])], consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_onnx_if_keeps_fusion_around_the_branch(tmp_path):
    """TVM's importer makes the ``If`` a Relax ``if``, outside any dataflow block: unfused,
    every operator would be a kernel. The grape pipeline fuses before and after it (inside
    a branch: ``test_branches_are_fused``; here TVM's importer computes the then branch's
    matmul and add before the ``if``, as they read only outer values); results equal
    onnxruntime on both branches."""
    ort = pytest.importorskip("onnxruntime")
    import onnx  # pylint: disable=import-outside-toplevel

    model = _onnx_if_between_layers()
    module = compile_onnx(model, {"n": (1, 16)}, "llvm", select_ops=0)
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    # Before the if, after it (matmul, add, tanh: one kernel), and the condition itself.
    assert {"fused_matmul_add", "fused_mean_greater", "fused_matmul_add_tir_tanh"} <= set(kernels)
    assert module.plan["host_steps"] == [] and len(module.plan["conditionals"]) == 1
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    executor = load(module.export(tmp_path / "m.grape"), "cpu")
    from onnx import numpy_helper  # pylint: disable=import-outside-toplevel

    w, b = (numpy_helper.to_array(t) for t in model.graph.initializer[:2])
    rng = np.random.default_rng(11)
    taken, paths = set(), set()
    for n in (1, 6, 6, 16, 6, 16):
        for _ in range(3):
            x = (3 * rng.standard_normal((n, 8))).astype(np.float32)
            want = session.run(None, {"x": x})[0]
            np.testing.assert_allclose(executor.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
            taken.add(bool((x @ w + b).mean() > 0))
            paths.add(executor.stats.last["path"])
    assert taken == {True, False} and paths == {"planned"}


def test_conditional_the_runtime_cannot_issue_is_a_host_step():
    mod = lowered(Branchy)
    gvar = mod.get_global_var("grape_cond_0")
    mod[gvar] = mod[gvar].with_attr("grape.branches", json.dumps({"error": "a branch holds x"}))
    plan = graph_plan(mod)
    (step,) = plan.host_steps
    assert step.op == "grape_cond_0" and "a branch holds x" in step.reason
    assert plan.branches == {}


def test_nested_conditional_the_runtime_cannot_issue_is_a_host_step():
    mod = lowered(Nested)
    inner = mod.get_global_var("grape_cond_0")
    mod[inner] = mod[inner].with_attr("grape.branches", json.dumps({"error": "inner"}))
    plan = graph_plan(mod)
    assert [s.op for s in plan.host_steps] == ["grape_cond_0"]
    assert [c.name for c in plan.conditionals] == ["grape_cond_1"]


def test_a_lost_branch_recording_is_made_again(tmp_path):
    """A region of the branch not taken that loses its recording (a bounded per-shape
    cache evicts it) is recorded again before the call launches it."""
    executor = load(_artifact(ResultIsOutput, tmp_path, select_ops=0), "cpu")
    vm = _vm(ResultIsOutput)
    x = np.random.default_rng(12).standard_normal((5, 16)).astype(np.float32)
    for cond in (True, False):
        _check(executor, vm, {"x": x, "cond": np.array(cond)}, ["x", "cond"])
    assert executor.stats.last["path"] == "planned"
    (conditional,) = executor.manifest["plan"]["conditionals"]
    (else_region,) = conditional["else_calls"]
    executor.backend._groups[else_region].where.pop((5,))  # pylint: disable=protected-access
    recordings = executor.stats.region_recordings
    paths = []
    for cond in (True, False, True):
        _check(executor, vm, {"x": x, "cond": np.array(cond)}, ["x", "cond"])
        paths.append(executor.stats.last["path"])
    assert paths == ["planned"] * 3
    assert executor.stats.region_recordings == recordings + 1


def test_early_exit_example_runs(tmp_path):
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    script = Path(__file__).resolve().parents[1] / "examples" / "early_exit.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 conditional region(s), 0 host step(s)" in proc.stdout
    assert "10 of 10 calls without the VM" in proc.stdout
    assert "read on the host 0 time(s)" in proc.stdout


def test_record_all_records_both_branches_at_every_size(tmp_path):
    """``record_all`` runs zeros (one branch) at each size: the other branch is recorded
    without running, so every later call at those sizes is planned, whichever branch."""
    executor = load(_artifact(Branchy, tmp_path, select_ops=0), "cpu")
    executor.record_all({"n": [2, 3, 4]}, progress=False)
    (conditional,) = executor.manifest["plan"]["conditionals"]
    recorded = executor.recorded_shapes
    for region in conditional["then_calls"] + conditional["else_calls"]:
        assert sorted(recorded[region]) == [(2,), (3,), (4,)]
    vm = _vm(Branchy)
    rng = np.random.default_rng(13)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    for n in (2, 3, 4):
        for cond in (False, True):
            x = rng.standard_normal((n, 16)).astype(np.float32)
            _check(executor, vm, {"x": x, "w": w, "cond": np.array(cond)}, ["x", "w", "cond"])
            assert executor.stats.last["path"] == "planned"


@I.ir_module
class StaticBranch:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32"),
             cond: R.Tensor((), "bool")):
        h = R.sum(x, axis=[0], keepdims=True)
        if cond:
            r = R.nn.relu(R.matmul(h, w))
        else:
            r = R.multiply(h, h)
        y = R.add(x, r)
        return y


def test_recorded_branches_are_issued_without_a_host_read_at_new_dims(tmp_path):
    """Without a call program (as for a model with host steps) the VM runs main. The
    branches work on (1, 16) whatever n is: once recorded, a call at a new n launches both,
    guarded, from the VM's call, instead of letting the VM read the condition."""
    module = build(fresh(StaticBranch), DIMS, "llvm", select_ops=0)
    executor = GraphExecutor(module.executable, tvm.cpu(), module.signature,
                             branches=module.plan["branches"])
    vm = _vm(StaticBranch)
    rng = np.random.default_rng(14)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    reads = []
    for n, cond in [(3, True), (3, False), (5, False), (7, True), (9, False), (9, True)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        _check(executor, vm, {"x": x, "w": w, "cond": np.array(cond)}, ["x", "w", "cond"])
        reads.append(executor.stats.last.get("host_branch_reads", 0))
    # Only the very first call reads it: then both branches are recorded at (1, 16).
    assert reads == [1, 0, 0, 0, 0, 0]
    assert executor.stats.host_branch_reads == 1


def test_the_call_program_never_reads_the_condition_on_the_host(tmp_path):
    """From the call program, the first call at new dims records both branches before it
    launches them, guarded: no call reads the condition, at any dims."""
    executor = load(_artifact(StaticBranch, tmp_path, select_ops=0), "cpu")
    vm = _vm(StaticBranch)
    rng = np.random.default_rng(15)
    w = rng.standard_normal((16, 16)).astype(np.float32)
    for n, cond in [(3, True), (3, False), (5, False), (7, True), (9, False), (9, True)]:
        x = rng.standard_normal((n, 16)).astype(np.float32)
        _check(executor, vm, {"x": x, "w": w, "cond": np.array(cond)}, ["x", "w", "cond"])
        assert executor.stats.last["path"] == "planned"
    assert executor.stats.host_branch_reads == 0
