"""``FullReduction``, grape's GPU schedule for reductions to one element, on CUDA builds made
without a GPU: which kernels it takes, that each loop is bound to threads, that an empty
reduction still writes its identity, and the branch model's mean kernel. The kernels'
values are checked on a GPU: ``tests/test_gpu.py`` on ``reductions.cuda.grape``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm_ffi.structural import WalkResult, structural_walk

import grape_tvm
from grape_tvm.compiler import _cuda_sources, nvcc_available
from grape_tvm.passes import FullReduction, TolerantRule, default_gpu_rules, unbound_kernels
from grape_tvm.passes.gpu_schedules import CudaCoreMatmul
from grape_tvm.pipeline import grape_pipeline
from test_passes import CUDA, legalized_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
op = relax.op


def _above(y):
    return op.greater(y, relax.const(0.0))


# Reductions to one element: the rule's.
FULL = {
    "mean": (("n", 512), op.mean, None),
    "mean_above": (("n", 512), op.mean, _above),  # models.branch_model's condition
    "sum_keepdims": (("n",), lambda x: op.sum(x, keepdims=True), None),
    "sum_all_keepdims": (("n", 512), lambda x: op.sum(x, axis=[0, 1], keepdims=True), None),
    "max": (("n", 512), op.max, None),
    "min": (("n",), op.min, None),
    "max_static": ((512,), op.max, None),
    "variance": (("n", 512), op.variance, None),  # two reductions in a row
}

# Reductions to several elements: dlight's.
NOT_FULL = {
    "row_max": ((4, "n"), lambda x: op.max(x, axis=[1]), None),
    "softmax": ((4, "n"), op.nn.softmax, None),
    "sum_rows_keepdims": (("n", 512), lambda x: op.sum(x, axis=[0], keepdims=True), None),
}


def _thread_extents(func: tirx.PrimFunc) -> dict[str, set[int | str]]:
    extents: dict[str, set] = {}

    def on_for(loop):
        if loop.thread_binding is not None:
            extent = loop.extent
            value = int(extent) if isinstance(extent, tirx.IntImm) else str(extent)
            extents.setdefault(loop.thread_binding.thread_tag, set()).add(value)

    structural_walk(func.body, ((tirx.For, on_for),))
    return extents


def _module(func: tirx.PrimFunc) -> tvm.IRModule:
    return tvm.IRModule({"k": func.with_attr("global_symbol", "k")})


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_reduction_binds_one_block_of_threads(name):
    sch = FullReduction().apply(legalized_kernel(*FULL[name]), CUDA, False)
    assert sch is not None
    func = sch.mod["main"]
    assert unbound_kernels(_module(func)) == []
    extents = _thread_extents(func)
    assert extents.keys() == {"blockIdx.x", "threadIdx.x"}
    assert extents["blockIdx.x"] == {1}
    # Over a symbolic extent, a block's worth; over 512 elements, 512 threads.
    assert extents["threadIdx.x"] == ({512} if name == "max_static" else {1024})


@pytest.mark.parametrize("name", sorted(NOT_FULL))
def test_full_reduction_leaves_reductions_to_several_elements(name):
    assert FullReduction().apply(legalized_kernel(*NOT_FULL[name]), CUDA, False) is None


def _tvm_rules():
    """grape's rule list without FullReduction: TVM's rules as they were."""
    return [TolerantRule(rule) for rule in (CudaCoreMatmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                            dl.gpu.GeneralReduction())] + [dl.gpu.Fallback()]


def _schedule(func: tirx.PrimFunc, rules) -> tirx.PrimFunc:
    with CUDA:
        return dl.ApplyDefaultSchedule(*rules)(_module(func))["k"]


@pytest.mark.parametrize("name", ["sum_keepdims", "sum_all_keepdims", *sorted(NOT_FULL)])
def test_default_rules_keep_dlight_schedules(name):
    """Sums to one element stay ``Reduction``'s (it comes first), row reductions
    ``GeneralReduction``'s: the same kernels as without the rule."""
    func = legalized_kernel(*{**FULL, **NOT_FULL}[name])
    tvm.ir.assert_structural_equal(_schedule(func, default_gpu_rules()),
                                   _schedule(func, _tvm_rules()))


def _stores(func: tirx.PrimFunc) -> tuple[set[str], set[str]]:
    """Names of the buffers stored to inside a loop of symbolic extent, and outside all."""
    inside, outside = set(), set()

    def collect(into):
        return lambda store: into.add(store.buffer.name)

    def on_for(loop):
        if isinstance(loop.extent, tirx.IntImm):
            return WalkResult.ADVANCE
        structural_walk(loop.body, ((tirx.BufferStore, collect(inside)),))
        return WalkResult.SKIP

    structural_walk(func.body, ((tirx.For, on_for), (tirx.BufferStore, collect(outside))),
                    order="pre")
    return inside, outside


@pytest.mark.parametrize("name", ["mean_above", "max", "variance"])
def test_empty_reduction_writes_its_identity(name):
    """Lowered as TVM lowers it (cross-thread reduction, init blocks): the loops over n
    only accumulate into each thread's register, which starts at the reducer's identity
    before them; the result is written after them. At n = 0 the loops do not run and the
    output is the identity (0; for a max, the lowest float, which grape's legalization turns
    into -inf). TVM's ``GeneralReduction`` schedule wrote its init inside the loops over n."""
    lower = tvm.transform.Sequential([s_tir.transform.LowerCrossThreadReduction(),
                                      s_tir.transform.LowerInitBlock()])
    func = legalized_kernel(*FULL[name])
    output = func.params[-1].name
    lowered = lower(_module(FullReduction().apply(func, CUDA, False).mod["main"]))["k"]
    inside, outside = _stores(lowered)
    assert inside and all(b.startswith("in_thread_") for b in inside)
    assert inside <= outside and output in outside
    if name == "mean_above":
        old = lower(_module(dl.gpu.GeneralReduction().apply(func, CUDA, False).mod["main"]))["k"]
        assert _stores(old)[0] == {"x_red"}


def _branch_model():
    from models import branch_model  # pylint: disable=import-outside-toplevel

    return branch_model(512)


def test_branch_model_mean_is_one_kernel_of_a_thousand_threads():
    """``models.branch_model``'s ``mean(h) > threshold`` over h: (n, 512): TVM's schedules
    left its reduction loops on the host, launching a one-thread kernel per element (n * 512
    launches a call). Now one launch of 1024 threads, and every kernel compiles with nvcc."""
    lowered = grape_pipeline(CUDA, {"n": (1, 1024)}, select_ops=0)(_branch_model())
    assert unbound_kernels(lowered) == []  # CheckDeviceKernels ran in the pipeline too
    assert _thread_extents(lowered["fused_mean_greater"])["threadIdx.x"] == {1024}

    module = grape_tvm.build(_branch_model(), {"n": (1, 1024)}, CUDA, select_ops=0,
                             output_names=["y"], prebuild_cubin=True)
    source = "\n".join(_cuda_sources(module.executable))
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(fused_mean\w*)\(",
                             source))
    assert kernels == {"fused_mean_greater_kernel"}
    assert "__launch_bounds__(1024) fused_mean_greater_kernel(" in source
    if not nvcc_available():
        pytest.skip("no nvcc here: the kernels were not compiled to cubin")
    assert module.cubins  # every kernel of the module, compiled by nvcc


def test_reductions_artifact_for_the_gpu_tests(tmp_path):
    """``bench/gpu/build_artifacts.py``'s ``reductions.cuda.grape`` builds (nvcc included),
    its means, max and min are ``FullReduction``'s, and ``models.reductions_numpy``, the
    GPU tests' reference, agrees with the model built for the CPU, n = 0 included."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "gpu"))
    import build_artifacts  # pylint: disable=import-outside-toplevel
    from models import (  # pylint: disable=import-outside-toplevel
        REDUCTION_OUTPUTS, reductions_model, reductions_numpy)

    build_artifacts.build_reductions(tmp_path)
    assert (tmp_path / "reductions.cuda.grape").stat().st_size > 0
    lowered = grape_pipeline(CUDA, build_artifacts.REDUCTION_DIMS)(reductions_model(512))
    for name in ("mean", "fused_mean_greater", "max", "min"):
        assert _thread_extents(lowered[name]) == {"blockIdx.x": {1}, "threadIdx.x": {1024}}

    module = grape_tvm.build(reductions_model(512), build_artifacts.REDUCTION_DIMS, "llvm",
                             output_names=list(REDUCTION_OUTPUTS))
    executor = grape_tvm.load(module.export(tmp_path / "reductions.grape"), "cpu")
    rng = np.random.default_rng(0)
    for n in (0, 5, 1024, 0):
        x = rng.standard_normal((n, 512)).astype(np.float32)
        got = executor.run({"x": x, "threshold": np.array(0.0, np.float32)})
        for name, want in reductions_numpy(x, 0.0).items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-2, err_msg=name)
