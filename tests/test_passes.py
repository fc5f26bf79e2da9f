"""Tests of grape-tvm's Relax/TIR passes on tiny IRModules.

Covers ``BoundShapeRanges``, ``LiftGraphRegions`` (through ``grape_pipeline`` and
``graph_plan``) and ``CheckDeviceKernels`` / ``unbound_kernels``. Nothing here needs a GPU:
CUDA modules are only lowered and built, never run.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from grape_tvm.passes import (
    REGION_ATTR,
    REGION_PREFIX,
    BoundShapeRanges,
    CheckDeviceKernels,
    HostFallbackError,
    LiftGraphRegions,
    graph_plan,
    unbound_kernels,
)
from grape_tvm.passes.lift_regions import classify
from grape_tvm.pipeline import grape_pipeline

LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
DIMS = {"n": (1, 64)}
D = 16


# -- tiny models -------------------------------------------------------------------------

@I.ir_module
class _MLP:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32"),
             b: R.Tensor((16,), "float32")):
        with R.dataflow():
            h = R.matmul(x, w)
            h2 = R.add(h, b)
            y = R.nn.relu(h2)
            R.output(y)
        return y


@I.ir_module
class _Branchy:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32"),
             cond: R.Tensor((), "bool")):
        h = R.matmul(x, w)
        if cond:
            r = R.nn.relu(h)
        else:
            r = R.multiply(h, h)
        y = R.add(r, x)
        return y


@I.ir_module
class _TwoFuncs:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32")):
        y = R.nn.relu(x)
        return y

    @R.function
    def static(x: R.Tensor((4, 16), "float32")):
        y = R.nn.relu(x)
        return y


@I.ir_module
class _Concat:
    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), y: R.Tensor(("m", 16), "float32")):
        c = R.concat([x, y], axis=0)
        r = R.nn.relu(c)
        return r


def fresh(mod: tvm.IRModule) -> tvm.IRModule:
    """A new IRModule holding the same functions: a pass that edits it leaves ``mod`` alone."""
    return tvm.IRModule(dict(mod.functions))


def attr_dict(func, key: str) -> dict[str, int]:
    return {str(k): int(v) for k, v in func.attrs[key].items()}


def has_attr(func, key: str) -> bool:
    return func.attrs is not None and key in func.attrs


# -- BoundShapeRanges --------------------------------------------------------------------

def test_bound_shape_ranges_sets_upper_and_lower_bound():
    out = BoundShapeRanges({"n": (1, 64)})(fresh(_TwoFuncs))
    main = out["main"]
    assert attr_dict(main, "tir_var_upper_bound") == {"n": 64}
    assert attr_dict(main, "tir_var_lower_bound") == {"n": 1}
    # A function that does not take n is left without bounds.
    assert not has_attr(out["static"], "tir_var_upper_bound")
    assert not has_attr(out["static"], "tir_var_lower_bound")


def test_bound_shape_ranges_accepts_lo_hi_string_and_keeps_other_bounds():
    func = _MLP["main"].with_attr("tir_var_upper_bound", {"k": 5})
    out = BoundShapeRanges({"n": "2:8"})(tvm.IRModule({"main": func}))
    assert attr_dict(out["main"], "tir_var_upper_bound") == {"k": 5, "n": 8}
    assert attr_dict(out["main"], "tir_var_lower_bound") == {"n": 2}


def test_bound_shape_ranges_unknown_dim_is_an_error_naming_it():
    with pytest.raises(ValueError) as err:
        BoundShapeRanges({"n": (1, 64), "seq": (1, 8)})(fresh(_MLP))
    msg = str(err.value)
    assert "'seq'" in msg
    assert "['n']" in msg  # the dimensions the module does have
    assert "'n'" not in msg.split("the symbolic dimensions")[0]  # n itself is fine


def test_bound_shape_ranges_rejects_an_empty_range():
    with pytest.raises(ValueError, match="'n'"):
        BoundShapeRanges({"n": (8, 2)})


def test_bound_shape_ranges_leaves_its_input_module_unchanged():
    mod = fresh(_MLP)
    out = BoundShapeRanges({"n": (1, 64)})(mod)
    assert attr_dict(out["main"], "tir_var_upper_bound") == {"n": 64}
    assert not has_attr(mod["main"], "tir_var_upper_bound")
    assert not out.same_as(mod)


def test_grape_pipeline_leaves_its_input_module_unchanged():
    mod = fresh(_MLP)
    grape_pipeline(LLVM, DIMS)(mod)
    assert not has_attr(mod["main"], "tir_var_upper_bound")


# -- LiftGraphRegions through the grape pipeline -----------------------------------------

@pytest.fixture(scope="module")
def mlp_lowered():
    return grape_pipeline(LLVM, DIMS)(fresh(_MLP))


@pytest.fixture(scope="module")
def branchy_lowered():
    return grape_pipeline(LLVM, DIMS, select_ops=0)(fresh(_Branchy))  # keep the if


def region_functions(mod: tvm.IRModule) -> dict[str, relax.Function]:
    return {gv.name_hint: f for gv, f in mod.functions.items()
            if isinstance(f, relax.Function) and has_attr(f, REGION_ATTR)}


def test_straight_line_model_is_one_region(mlp_lowered):
    plan = graph_plan(mlp_lowered)
    assert plan.host_steps == []
    assert len(plan.regions) == 1
    region = plan.regions[0]
    assert region.name == f"{REGION_PREFIX}0"
    assert region.kernels == ["fused_matmul_add_relu"]
    assert region.symbolic_vars == ["n"]
    assert set(region_functions(mlp_lowered)) == {region.name}
    # The plan is JSON-ready and says the same.
    js = plan.to_json()
    assert [r["name"] for r in js["regions"]] == [region.name]
    assert js["host_steps"] == []


def test_region_function_is_marked_and_takes_its_shape_last(mlp_lowered):
    func = mlp_lowered[f"{REGION_PREFIX}0"]
    assert int(func.attrs[REGION_ATTR]) == 0
    last = func.params[-1]
    assert isinstance(last.ty, relax.ShapeType)
    assert [str(v) for v in last.ty.values] == ["n"]
    # It hands that shape back (see LiftGraphRegions: a void return crashes TVM's VM).
    assert isinstance(func.ret_ty, relax.ShapeType)
    # Every tensor the region touches is a parameter: x, w, b and the output buffer.
    tensors = [p for p in func.params[:-1] if isinstance(p.ty, relax.TensorType)]
    assert len(tensors) == len(func.params) - 1 == 4


def test_branch_is_a_conditional_region_between_two_regions(branchy_lowered):
    plan = graph_plan(branchy_lowered)
    assert plan.host_steps == []  # the branch became a conditional region (test_branches.py)
    (conditional,) = plan.conditionals
    assert conditional.condition == "cond"
    by_name = {r.name: r for r in plan.regions}
    assert [by_name[c].kernels for c in conditional.then_calls] == [["relu"]]
    assert [by_name[c].kernels for c in conditional.else_calls] == [["multiply"]]
    for region in plan.regions:
        func = branchy_lowered[region.name]
        assert int(func.attrs[REGION_ATTR]) == int(region.name[len(REGION_PREFIX):])
        assert isinstance(func.params[-1].ty, relax.ShapeType)

    # In main: a region, then the conditional region, then a region.
    order = []
    for block in branchy_lowered["main"].body.blocks:
        for binding in block.bindings:
            kind, op, _ = classify(binding, branchy_lowered)
            if kind in ("region", "conditional"):
                order.append(kind)
    assert order == ["region", "conditional", "region"]


def test_cheap_branches_become_selects_in_one_region():
    lowered = grape_pipeline(LLVM, DIMS)(fresh(_Branchy))
    plan = graph_plan(lowered)
    assert plan.host_steps == [] and len(plan.regions) == 1
    assert any("where" in k for k in plan.regions[0].kernels)


def test_static_model_region_takes_an_empty_shape():
    @I.ir_module
    class Static:
        @R.function
        def main(x: R.Tensor((4, 16), "float32")):
            r = R.nn.relu(x)
            s = R.add(r, x)
            return s

    lowered = grape_pipeline(LLVM)(Static)
    plan = graph_plan(lowered)
    assert [r.kernels for r in plan.regions] == [["fused_relu_add"]]  # dataflow blocks: fused
    assert plan.regions[0].symbolic_vars == []
    assert plan.host_steps == []
    assert list(lowered[f"{REGION_PREFIX}0"].params[-1].ty.values) == []


def test_lift_graph_regions_again_changes_nothing(mlp_lowered):
    again = LiftGraphRegions()(mlp_lowered)
    assert set(region_functions(again)) == set(region_functions(mlp_lowered))
    tvm.ir.assert_structural_equal(again["main"], mlp_lowered["main"])


def test_region_kernels_are_device_kernels_only():
    lowered = grape_pipeline(LLVM, {"n": (1, 64), "m": (1, 8)})(fresh(_Concat))
    plan = graph_plan(lowered)
    assert len(plan.regions) == 1
    for name in plan.regions[0].kernels:
        func = lowered[name]
        assert isinstance(func, tvm.tirx.PrimFunc)
        assert not (func.attrs is not None and func.attrs.get("tirx.is_host_func", False)), name
    # The concatenation takes its consumer (FuseIntoConcatenations: injective, not opaque).
    assert plan.regions[0].kernels == ["fused_concatenate_relu"]


# -- the lifted module computes what TVM's own build computes -----------------------------

def _vm(ex) -> relax.VirtualMachine:
    return relax.VirtualMachine(ex, tvm.cpu())


def _run(vm, *arrays) -> np.ndarray:
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


@pytest.mark.parametrize("n", [1, 7, 64])
def test_lifted_mlp_matches_plain_vm(n, mlp_lowered, mlp_plain_vm, mlp_lifted_vm):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, D)).astype("float32")
    w = rng.standard_normal((D, D)).astype("float32")
    b = rng.standard_normal((D,)).astype("float32")
    got = _run(mlp_lifted_vm, x, w, b)
    want = _run(mlp_plain_vm, x, w, b)
    assert got.shape == (n, D)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.maximum(x @ w + b, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("cond", [True, False])
def test_lifted_branch_matches_plain_vm(n, cond, branchy_plain_vm, branchy_lifted_vm):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, D)).astype("float32")
    w = rng.standard_normal((D, D)).astype("float32")
    c = np.array(cond)
    got = _run(branchy_lifted_vm, x, w, c)
    want = _run(branchy_plain_vm, x, w, c)
    assert got.shape == (n, D)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    h = x @ w
    ref = (np.maximum(h, 0) if cond else h * h) + x
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def mlp_plain_vm():
    return _vm(tvm.compile(fresh(_MLP), target=LLVM))


@pytest.fixture(scope="module")
def mlp_lifted_vm(mlp_lowered):
    return _vm(tvm.compile(mlp_lowered, target=LLVM, relax_pipeline=None))


@pytest.fixture(scope="module")
def branchy_plain_vm():
    return _vm(tvm.compile(fresh(_Branchy), target=LLVM))


@pytest.fixture(scope="module")
def branchy_lifted_vm(branchy_lowered):
    return _vm(tvm.compile(branchy_lowered, target=LLVM, relax_pipeline=None))


@pytest.fixture(scope="module")
def branchy_selected_vm():
    return _vm(tvm.compile(grape_pipeline(LLVM, DIMS)(fresh(_Branchy)), target=LLVM,
                           relax_pipeline=None))


@pytest.mark.parametrize("cond", [True, False])
def test_selected_branch_matches_plain_vm(cond, branchy_plain_vm, branchy_selected_vm):
    for n in (1, 9, 64):
        rng = np.random.default_rng(n)
        x = rng.standard_normal((n, D)).astype("float32")
        w = rng.standard_normal((D, D)).astype("float32")
        c = np.array(cond)
        np.testing.assert_allclose(_run(branchy_selected_vm, x, w, c),
                                   _run(branchy_plain_vm, x, w, c), rtol=1e-5, atol=1e-5)


# -- CheckDeviceKernels / unbound_kernels ------------------------------------------------

@pytest.fixture(scope="module")
def cuda_legalized():
    """PrimFuncs straight out of LegalizeOps: loops, no blockIdx/threadIdx."""
    with CUDA:
        return relax.transform.LegalizeOps()(fresh(_MLP))


def test_unbound_kernels_lists_legalized_primfuncs(cuda_legalized):
    assert unbound_kernels(cuda_legalized) == ["add", "matmul", "relu"]


def test_check_device_kernels_names_the_unbound_functions(cuda_legalized):
    # Through TVM's FFI the error arrives as a RuntimeError (see the xfail test below).
    with pytest.raises(RuntimeError) as err:
        CheckDeviceKernels()(cuda_legalized)
    msg = str(err.value)
    assert "without a thread binding" in msg
    assert "add, matmul, relu" in msg


@I.ir_module
class _Unscheduled:
    """A kernel that claims to be scheduled, so dlight leaves it alone: no thread binding."""

    @T.prim_func
    def copy_serial(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        T.func_attr({"tirx.is_scheduled": True})
        for i in range(16):
            b[i] = a[i]

    @R.function
    def main(x: R.Tensor((16,), "float32")):
        cls = _Unscheduled
        y = R.call_tir(cls.copy_serial, (x,), out_ty=R.Tensor((16,), "float32"))
        return y


def test_grape_build_raises_host_fallback_error_naming_the_kernel():
    import grape_tvm  # pylint: disable=import-outside-toplevel

    with pytest.raises(HostFallbackError, match="copy_serial"):
        grape_tvm.build(fresh(_Unscheduled), target=CUDA, prebuild_cubin=False)
    # The same module is fine for the CPU: nothing is checked there.
    grape_tvm.build(fresh(_Unscheduled), target=LLVM)


def test_grape_pipeline_on_cuda_binds_every_kernel():
    lowered = grape_pipeline(CUDA, DIMS, matmul="tvm")(fresh(_MLP))  # CheckDeviceKernels runs inside
    assert unbound_kernels(lowered) == []
    kernels = [gv.name_hint for gv, f in lowered.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)
               and not (f.attrs is not None and f.attrs.get("tirx.is_host_func", False))]
    assert kernels == ["fused_matmul_add_relu"]
    assert CheckDeviceKernels()(lowered).same_as(lowered)
    plan = graph_plan(lowered)
    assert [r.kernels for r in plan.regions] == [["fused_matmul_add_relu"]]
    assert plan.host_steps == []


@I.ir_module
class _Kernels:
    @T.prim_func
    def bound_loop(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        for i in T.thread_binding(16, thread="threadIdx.x"):
            b[i] = a[i]

    @T.prim_func
    def launched(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        tx = T.launch_thread("threadIdx.x", 16)
        b[tx] = a[tx]

    @T.prim_func
    def serial(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        for i in range(16):
            b[i] = a[i]

    @T.prim_func
    def host_helper(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        T.func_attr({"tirx.is_host_func": True})
        for i in range(16):
            b[i] = a[i]

    @T.prim_func
    def no_params():
        T.evaluate(0)


def test_unbound_kernels_on_handwritten_primfuncs():
    assert unbound_kernels(_Kernels) == ["serial"]
    with pytest.raises(RuntimeError, match="serial"):
        CheckDeviceKernels()(_Kernels)
    # The same loop explicitly compiled for the host is not a device kernel.
    funcs = dict(_Kernels.functions)
    gv = next(g for g in funcs if g.name_hint == "serial")
    funcs[gv] = funcs[gv].with_attr("target", tvm.target.Target({"kind": "llvm"}))
    mod = tvm.IRModule(funcs)
    assert unbound_kernels(mod) == []
    assert CheckDeviceKernels()(mod).same_as(mod)


@I.ir_module
class _HostLoops:
    """Kernels launched from host loops, and loops that are fine around or inside a kernel."""

    @T.prim_func
    def launch_per_element(a: T.Buffer((8, 16), "float32"), s: T.Buffer((), "float32")):
        for i, j in T.grid(8, 16):  # host loops: 128 launches of one thread
            for u in T.thread_binding(1, thread="blockIdx.x"):
                s[()] = s[()] + a[i, j]

    @T.prim_func
    def launch_per_row(a: T.Buffer((8, 16), "float32"), b: T.Buffer((8, 16), "float32")):
        for i in range(8):
            tx = T.launch_thread("threadIdx.x", 16)
            b[i, tx] = a[i, tx]

    @T.prim_func
    def unit_loop_around(a: T.Buffer((16,), "float32"), b: T.Buffer((16,), "float32")):
        for i in range(1):  # one launch
            for t in T.thread_binding(16, thread="threadIdx.x"):
                b[t] = a[t]

    @T.prim_func
    def serial_inside(a: T.Buffer((16, 8), "float32"), b: T.Buffer((16,), "float32")):
        for t in T.thread_binding(16, thread="threadIdx.x"):
            for k in range(8):  # device code
                b[t] = b[t] + a[t, k]


def test_kernel_check_refuses_a_kernel_launched_from_a_host_loop():
    """Every store under a thread binding, but loops without one around it: codegen makes
    those loops host code launching the kernel per iteration."""
    assert unbound_kernels(_HostLoops) == ["launch_per_element", "launch_per_row"]
    with pytest.raises(RuntimeError, match="launch_per_element, launch_per_row"):
        CheckDeviceKernels()(_HostLoops)


def legalized_kernel(shape, make, epilogue=None) -> tvm.tirx.PrimFunc:
    """The one PrimFunc of ``make(x)`` (then ``epilogue``) on a float32 ``x`` of ``shape``
    ("n" a symbolic dim), legalized as grape does it and fused, before any schedule."""
    n = tvm.tirx.Var("n", "int64")
    ty = relax.TensorType([n if d == "n" else d for d in shape], "float32")
    return fused_kernel_of(lambda x: epilogue(make(x)) if epilogue else make(x), ty,
                           names=("x",))


def fused_kernel(mod: tvm.IRModule) -> tvm.tirx.PrimFunc:
    """The one PrimFunc of ``mod``'s ``main``, legalized as grape does it and fused."""
    # pylint: disable=import-outside-toplevel
    from grape_tvm.passes import gpu_legalize_passes, numerics_legalize_map

    unscheduled = [p for p in gpu_legalize_passes(numerics_legalize_map(gpu=True))
                   if p.info.name != "ApplyDefaultSchedule"]
    with CUDA:
        mod = tvm.transform.Sequential(unscheduled)(mod)
    (func,) = [f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    return func


def fused_kernel_of(make, *types, names=None) -> tvm.tirx.PrimFunc:
    """The one PrimFunc of ``make(*params)`` over parameters of ``types``, named ``names``
    (x0, x1, ... by default), legalized and fused (``fused_kernel``)."""
    names = names or [f"x{i}" for i in range(len(types))]
    params = [relax.Var(name, ty) for name, ty in zip(names, types)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(*params))
        bb.emit_func_output(out)
    return fused_kernel(bb.get())


def _scheduled(rule, func) -> tvm.IRModule:
    sch = rule.apply(func, CUDA, False)
    return tvm.IRModule({"k": sch.mod["main"].with_attr("global_symbol", "k")})


def test_kernel_check_on_dlight_reductions():
    """dlight's schedule of ``mean`` over (n, 512) to a scalar (``GeneralReduction``: the
    reduction loops outside its unit thread bindings) is refused; its row reductions, with
    loops inside the bindings, are not."""
    from tvm.s_tir import dlight as dl  # pylint: disable=import-outside-toplevel

    mean = legalized_kernel(("n", 512), relax.op.mean)
    assert unbound_kernels(_scheduled(dl.gpu.GeneralReduction(), mean)) == ["k"]
    row_sum = legalized_kernel((4, "n"), lambda x: relax.op.sum(x, axis=[1]))
    softmax = legalized_kernel((4, "n"), relax.op.nn.softmax)
    assert unbound_kernels(_scheduled(dl.gpu.Reduction(), row_sum)) == []
    assert unbound_kernels(_scheduled(dl.gpu.GeneralReduction(), softmax)) == []


# -- IfToSelect ------------------------------------------------------------------------------

@I.ir_module
class _IntBranch:
    @R.function
    def main(a: R.Tensor((4,), "int32"), b: R.Tensor((4,), "int32"), cond: R.Tensor((), "bool")):
        if cond:
            r = R.floor_divide(a, b)  # would trap on b == 0 when not taken
        else:
            r = R.add(a, b)
        return r


@I.ir_module
class _GuardedTake:
    @R.function
    def main(x: R.Tensor((3, 8), "float32"), i: R.Tensor((), "int64")):
        inside = R.less(i, R.const(3, "int64"))
        if inside:
            r = R.take(x, i, axis=0)  # read out of bounds when not taken: the if guards it
        else:
            r = R.sum(x, axis=[0])
        return r


def _has_if(mod) -> bool:
    return any(isinstance(b.value, relax.If) for blk in mod["main"].body.blocks for b in blk.bindings)


def test_an_index_read_the_if_guards_stays_in_its_branch(tmp_path):
    """``if i < 3: take(x, i)``: as a select, the take ran on every call, reading out of
    bounds (a segfault at i = 10**6, garbage read at i = 5); it stays a conditional region
    and every call equals TVM's VM."""
    import grape_tvm  # pylint: disable=import-outside-toplevel
    from grape_tvm.passes import IfToSelect  # pylint: disable=import-outside-toplevel

    assert _has_if(IfToSelect()(fresh(_GuardedTake)))
    module = grape_tvm.build(fresh(_GuardedTake), {}, "llvm")
    assert len(module.plan["conditionals"]) == 1
    executor = grape_tvm.load(module.export(tmp_path / "take.grape"))
    vm = relax.VirtualMachine(tvm.compile(fresh(_GuardedTake), "llvm"), tvm.cpu())
    x = np.arange(24, dtype=np.float32).reshape(3, 8)
    for i in (0, 2, 5, 10**6, 1):
        index = np.array(i, np.int64)
        want = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(index)).numpy()
        np.testing.assert_array_equal(executor.run({"x": x, "i": index})["output_0"], want)


def test_if_to_select_keeps_branches_outside_its_rule():
    from grape_tvm.passes import IfToSelect

    assert _has_if(IfToSelect()(fresh(_IntBranch)))  # integer division
    assert _has_if(IfToSelect(max_ops=0)(fresh(_Branchy)))  # too many ops for the bound
    selected = relax.transform.Normalize()(IfToSelect()(fresh(_Branchy)))
    assert not _has_if(selected)
    calls = [b.value.op.name for blk in selected["main"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and hasattr(b.value.op, "name")]
    assert "relax.where" in calls and "relax.nn.relu" in calls and "relax.multiply" in calls


def _conv_slice_module(begin: int = 0, extra_use: bool = False) -> tvm.IRModule:
    """``conv1d(x, w, padding=[2, 2]) + bias``, sliced ``[..., begin:-1]`` on a symbolic length."""
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, 4, n), "float32"))
    w = relax.Var("w", relax.TensorType((4, 2, 4), "float32"))
    b = relax.Var("b", relax.TensorType((1, 4, 1), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv1d(x, w, padding=[2, 2], groups=2))
            biased = bb.emit(relax.op.add(conv, b))
            out = bb.emit(relax.op.strided_slice(biased, [2], [begin], [n], assume_inbound=True))
            if extra_use:
                out = bb.emit(relax.op.add(out, relax.op.strided_slice(
                    biased, [2], [1], [n + 1], assume_inbound=True)))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def _run_llvm(mod: tvm.IRModule, *args: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_slice_into_conv_padding_drops_the_slice_and_keeps_the_values():
    from grape_tvm.passes import SliceIntoConvPadding

    mod = _conv_slice_module()
    new = SliceIntoConvPadding()(mod)
    text = new.script()
    assert "strided_slice" not in text and "padding=[2, 1]" in text
    rng = np.random.default_rng(0)
    for n in (1, 9, 30):
        args = [rng.standard_normal(s).astype("float32") for s in [(1, 4, n), (4, 2, 4), (1, 4, 1)]]
        want = _run_llvm(mod, *args)
        assert want.shape == (1, 4, n)
        np.testing.assert_allclose(_run_llvm(new, *args), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("begin, extra_use", [(1, False), (0, True)])
def test_slice_into_conv_padding_leaves_other_slices(begin, extra_use):
    """A slice from 1 is not a trimmed end; a conv output read twice is needed whole."""
    from tvm_ffi.structural import structural_equal

    from grape_tvm.passes import SliceIntoConvPadding

    mod = _conv_slice_module(begin, extra_use)
    assert structural_equal(SliceIntoConvPadding()(mod), mod)


def test_name_derived_dims_defines_names_up_front_and_reshapes_stay_views():
    """Derived dims computed from the parameters' dims are named once at the start (a shape
    cast), tensors take the names through reshapes that stay views: one graph region on CUDA."""
    from grape_tvm.passes import NameDerivedDims

    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((1, n), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            half = bb.emit(relax.op.strided_slice(x, [1], [0], [n // 2], assume_inbound=True))
            soft = bb.emit(relax.op.nn.softmax(relax.op.exp(half)))
            out = bb.emit_output(relax.op.nn.softmax(relax.op.add(soft, soft)))
        bb.emit_func_output(out)
    mod = BoundShapeRanges({"n": (2, 64)})(bb.get())
    named = NameDerivedDims()(mod)
    first = named["main"].body.blocks[0].bindings[:3]
    assert [type(b).__name__ for b in first] == ["VarBinding", "MatchCast", "MatchCast"]
    assert "R.reshape" in named.script() and named.script().count("R.match_cast") == 2
    lowered = grape_pipeline(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), {"n": (2, 64)})(mod)
    plan = graph_plan(lowered)
    assert len(plan.regions) == 1
    # The renaming reshape is a view (vm.builtin.reshape), not a copy kernel in the region.
    assert "vm.builtin.reshape" in lowered["main"].script()
    assert "reshape" not in lowered["grape_region_0"].script().replace("vm.builtin.reshape", "")
    x_np = np.random.default_rng(0).standard_normal((1, 37)).astype("float32")
    np.testing.assert_allclose(_run_llvm(named, x_np), _run_llvm(mod, x_np), rtol=1e-6)


def _gemv_kernel():
    """The PrimFunc of ``(batch, 1, 64) @ (64, 128)``, as legalization makes it."""
    from tvm import tirx  # pylint: disable=import-outside-toplevel

    batch = tirx.Var("batch", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 1, 64), "float32"))
    w = relax.Var("w", relax.TensorType((64, 128), "float32"))
    with bb.function("main", [x, w]):
        out = bb.emit(relax.op.matmul(x, w))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    return next(f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


def test_kernel_check_refuses_a_kernel_left_partly_on_the_host():
    """A schedule that binds the main loop nest but leaves other blocks as serial loops
    (TVM 0.27's ``LowBatchGEMV`` on a decode matmul over a symbolic batch: its padding copies
    and the last reduction steps) would write device memory from the host: refused."""
    from tvm.s_tir import dlight as dl  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    sch = dl.gpu.LowBatchGEMV(4).apply(_gemv_kernel(), target, False)
    assert "threadIdx" in sch.mod.script()  # bound in part
    partly = tvm.IRModule({"gemv": sch.mod["main"].with_attr("global_symbol", "gemv")})
    assert unbound_kernels(partly) == ["gemv"]
    with target:
        whole = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.Fallback())(
            tvm.IRModule({"gemv": _gemv_kernel().with_attr("global_symbol", "gemv")}))
    assert unbound_kernels(whole) == []  # TVM's order: a whole GPU kernel
