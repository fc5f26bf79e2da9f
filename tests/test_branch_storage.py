"""TVM 0.27's memory planner and ``if``: a storage defined in one branch, used elsewhere.

``StaticPlanBlockMemory`` plans per binding block but keeps one pool of free storage per
function, and defines each storage at its first use: a storage first used in the then
branch and freed there is reused by the else branch (or after the ``if``), where it is not
defined. The VM then reads an unset register: a segfault. ``HoistBranchStorage`` defines
such a storage before the ``if``. The pass on tiny IRModules, then TVM's own pipeline and
grape's on ``models.branch_model`` (the segfault's model) and on a model grape's pipeline
plans the same way, on both branches against numpy.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import grape_tvm
from grape_tvm.passes import HoistBranchStorage, after_memory_planning

ROOT = Path(__file__).resolve().parents[1]
LLVM = tvm.target.Target({"kind": "llvm"})


@I.ir_module
class ReuseInElse:
    @R.function
    def main(x: R.Tensor((4,), "float32"), cond: R.Tensor((), "bool")):
        if cond:
            a = R.exp(x)
            r = R.exp(a)
        else:
            b = R.sin(x)
            r = R.sin(b)
        return r


@I.ir_module
class ReuseAfterIf:
    @R.function
    def main(x: R.Tensor((4,), "float32"), cond: R.Tensor((), "bool")):
        if cond:
            a = R.exp(x)
            r = R.exp(a)
        else:
            r = R.sin(x)
        c = R.sin(r)
        d = R.sin(c)
        return d


def _planned(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` lowered up to TVM's memory planning, as TVM's pipelines run it."""
    seq = [relax.transform.LegalizeOps(), relax.transform.ToNonDataflow(),
           relax.transform.CallTIRRewrite(), relax.transform.StaticPlanBlockMemory()]
    out = tvm.transform.Sequential(seq)(tvm.IRModule(dict(mod.functions)))
    # Destination-passing calls are impure: say so, as RemovePurityChecking would, so that
    # the well-formedness check looks at the variables.
    out["main"] = out["main"].with_attr("relax.force_pure", True)
    return out


def _bindings(seq) -> list:
    return [b for block in seq.blocks for b in block.bindings]


def _op(binding) -> str:
    value = binding.value
    return value.op.name if isinstance(value, relax.Call) and hasattr(value.op, "name") else ""


def _run(mod: tvm.IRModule, x: np.ndarray, cond: bool) -> np.ndarray:
    rest = [relax.transform.LowerAllocTensor(), relax.transform.KillAfterLastUse(),
            relax.transform.LowerRuntimeBuiltin(), relax.transform.ComputePrimValue(),
            relax.transform.VMShapeLower(), relax.transform.AttachGlobalSymbol()]
    with LLVM:
        lowered = tvm.transform.Sequential(rest)(mod)
    vm = relax.VirtualMachine(tvm.compile(lowered, LLVM, relax_pipeline=None), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(np.array(cond))).numpy()


def test_tvm_planner_leaves_a_storage_undefined_in_the_else_branch():
    """The TVM bug itself: if TVM fixes it, this fails, and the pass can go."""
    with pytest.raises(ValueError, match="Var storage is not defined"):
        relax.analysis.well_formed(_planned(ReuseInElse))
    with pytest.raises(ValueError, match="Var storage is not defined"):
        relax.analysis.well_formed(_planned(ReuseAfterIf))


def test_storage_shared_by_both_branches_is_defined_before_the_if():
    fixed = HoistBranchStorage()(_planned(ReuseInElse))
    relax.analysis.well_formed(fixed)
    main = _bindings(fixed["main"].body)
    (storage,) = [b for b in main if _op(b) == "relax.memory.alloc_storage"]
    branch_if = main[-1].value
    assert main.index(storage) < len(main) - 1 and isinstance(branch_if, relax.If)
    for side in (branch_if.true_branch, branch_if.false_branch):
        assert not any(_op(b) == "relax.memory.alloc_storage" for b in _bindings(side))
        (alloc,) = [b for b in _bindings(side) if _op(b) == "relax.memory.alloc_tensor"]
        assert alloc.value.args[0].same_as(storage.var)  # one storage, as planned
    # Its size and scope are the planner's.
    assert [int(v) for v in storage.value.args[0].values] == [16]
    x = np.linspace(-1, 1, 4).astype(np.float32)
    np.testing.assert_allclose(_run(fixed, x, True), np.exp(np.exp(x)), rtol=1e-6)
    np.testing.assert_allclose(_run(fixed, x, False), np.sin(np.sin(x)), rtol=1e-6)


def test_storage_reused_after_the_if_is_defined_before_it():
    fixed = HoistBranchStorage()(_planned(ReuseAfterIf))
    relax.analysis.well_formed(fixed)
    main = _bindings(fixed["main"].body)
    kinds = [("if" if isinstance(b.value, relax.If) else _op(b)) for b in main]
    assert kinds.index("relax.memory.alloc_storage") < kinds.index("if")
    x = np.linspace(-1, 1, 4).astype(np.float32)
    for cond, r in ((True, np.exp(np.exp(x))), (False, np.sin(x))):
        np.testing.assert_allclose(_run(fixed, x, cond), np.sin(np.sin(r)), rtol=1e-5)


def test_well_formed_modules_are_left_alone():
    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((4,), "float32"), cond: R.Tensor((), "bool")):
            a = R.exp(x)
            b = R.exp(a)
            if cond:
                r = R.sin(b)
            else:
                r = R.cos(b)
            return r

    planned = _planned(Plain)
    assert HoistBranchStorage()(planned).same_as(planned)


def test_after_memory_planning_inserts_the_pass_once():
    passes = [relax.transform.LegalizeOps(), relax.transform.StaticPlanBlockMemory(),
              relax.transform.LowerAllocTensor()]
    names = [p.info.name for p in after_memory_planning(passes)]
    assert names == ["LegalizeOps", "StaticPlanBlockMemory", "HoistBranchStorage",
                     "LowerAllocTensor"]
    with pytest.raises(ValueError, match="StaticPlanBlockMemory"):
        after_memory_planning([relax.transform.LegalizeOps()])


# -- TVM's own pipeline and grape's on the branch model --------------------------------

_TVM_BRANCH_MODEL = textwrap.dedent("""
    import sys
    import numpy as np
    import tvm
    from tvm import relax
    sys.path.insert(0, {bench!r})
    from models import BRANCH_WEIGHTS, branch_model, branch_numpy, branch_weights
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from grape_tvm.passes import after_memory_planning

    target = tvm.target.Target({{"kind": "llvm"}})

    @tvm.transform.module_pass(opt_level=0, name="TVMDefaultWithRepair")
    def pipeline(mod, _ctx):
        with target:
            return tvm.transform.Sequential(
                cpu.library_dispatch_passes(target) + cpu.legalize_passes(target)
                + cpu.dataflow_lower_passes(target)
                + after_memory_planning(cpu.finalize_passes(target)))(mod)

    vm = relax.VirtualMachine(tvm.compile(branch_model(64), target, relax_pipeline=pipeline),
                              tvm.cpu())
    w = branch_weights(64)
    for n in (1, 5, 17):
        x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
        for threshold in (-10.0, 10.0):  # then branch, else branch
            args = [x, *[w[k] for k in BRANCH_WEIGHTS], np.array(threshold, np.float32)]
            got = vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()
            np.testing.assert_allclose(got, branch_numpy(x, w, threshold), rtol=1e-4, atol=1e-4)
    print("both branches ok")
""")


def test_tvm_default_pipeline_with_the_repair_runs_both_branches():
    """TVM's default CPU pipeline segfaults on the else branch of ``branch_model`` (issue
    13, item 12): with ``HoistBranchStorage`` after its memory planning, both branches
    equal numpy. In a subprocess: a regression crashes that process, not pytest."""
    script = _TVM_BRANCH_MODEL.format(bench=str(ROOT / "bench"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, check=False, cwd=ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stdout}{proc.stderr[-3000:]}"
    assert "both branches ok" in proc.stdout


@I.ir_module
class TwoLayerBranches:
    """Two matmuls in each branch (no fusion between them): each branch has an
    intermediate the planner places in one storage, first used by the then branch."""

    @R.function
    def main(x: R.Tensor(("n", 16), "float32"), w: R.Tensor((16, 16), "float32"),
             cond: R.Tensor((), "bool")):
        if cond:
            a = R.matmul(x, w)
            r = R.matmul(a, w)
        else:
            b = R.matmul(x, R.permute_dims(w))
            r = R.matmul(b, R.permute_dims(w))
        return r


def _branch_model_module():
    sys.path.insert(0, str(ROOT / "bench"))
    import models  # pylint: disable=import-outside-toplevel

    return models


@pytest.mark.parametrize("device_branches", [True, False])
def test_grape_builds_of_the_branch_model_run_both_branches(tmp_path, device_branches):
    models = _branch_model_module()
    module = grape_tvm.build(models.branch_model(64), {"n": (1, 32)}, "llvm", select_ops=0,
                             device_branches=device_branches)
    executor = grape_tvm.load(module.export(tmp_path / "b.grape"), "cpu")
    w = models.branch_weights(64)
    for n in (1, 5, 32, 5):
        x = np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)
        for threshold in (-10.0, 10.0):
            (got,) = executor.run({"x": x, **w, "threshold": np.array(threshold, np.float32)}).values()
            np.testing.assert_allclose(got, models.branch_numpy(x, w, threshold), rtol=1e-4, atol=1e-4)


_GRAPE_TWO_LAYER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import grape_tvm
    from test_branch_storage import TwoLayerBranches

    module = grape_tvm.build(TwoLayerBranches, {{"n": (1, 32)}}, "llvm", select_ops=0,
                             device_branches={device_branches})
    executor = grape_tvm.load(module.export({path!r}), "cpu")
    w = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    for n in (3, 32, 3):
        x = np.random.default_rng(n).standard_normal((n, 16)).astype(np.float32)
        for cond in (True, False):
            (got,) = executor.run({{"x": x, "w": w, "cond": np.array(cond)}}).values()
            want = x @ w @ w if cond else x @ w.T @ w.T
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    print("both branches ok")
""")


@pytest.mark.parametrize("device_branches", [True, False])
def test_grape_build_whose_planner_shares_a_branch_storage(tmp_path, device_branches):
    """grape's pipeline runs TVM's planner too: with the ``if`` left to the VM, the else
    branch's intermediate reuses the then branch's storage (a segfault without the
    repair, hence the subprocess)."""
    script = _GRAPE_TWO_LAYER.format(tests=str(ROOT / "tests"), device_branches=device_branches,
                                     path=str(tmp_path / "m.grape"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, check=False, cwd=ROOT)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stdout}{proc.stderr[-3000:]}"
    assert "both branches ok" in proc.stdout


def test_bench_tvm_baseline_of_the_branch_model_is_well_formed():
    """``bench/gpu/build_artifacts.py``'s ``branches.tvm_vm`` (TVM's CUDA pipeline with
    grape's schedule rules): with the repair its else branch defines what it uses."""
    sys.path.insert(0, str(ROOT / "bench" / "gpu"))
    import build_artifacts  # pylint: disable=import-outside-toplevel

    models = _branch_model_module()
    bounded = build_artifacts._upper_bounded(models.branch_model(64), {"n": 1024})
    broken = build_artifacts._tvm_pipeline_grape_schedules()(bounded)
    with pytest.raises(ValueError, match="is not defined"):
        relax.analysis.well_formed(broken, check_ty=False)
    repaired = build_artifacts._tvm_pipeline_grape_schedules(repair_branch_storage=True)(bounded)
    relax.analysis.well_formed(repaired, check_ty=False)
