"""``Conv1dAsMatmul``: a conv1d as the gather of its windows and a matmul, on the IR and
in results (llvm) against numpy; on CUDA the matmul is cuBLASLt's (tests/test_gpu.py runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import grape_tvm
from grape_tvm.loader import load
from grape_tvm.passes.conv_matmul import MIN_REDUCTION, Conv1dAsMatmul
from grape_tvm.passes.conv_slice import SliceIntoConvPadding

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
# pylint: disable=wrong-import-position
from models import (CONV_STACK, conv1d_numpy, conv_stack, conv_stack_numpy,  # noqa: E402
                    conv_stack_weights)

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _conv_module(channels: int, out: int, kernel: int, groups: int = 1, stride: int = 1,
                 padding: int = 0, dilation: int = 1, dtype: str = "float32",
                 batch: int | None = None) -> tvm.IRModule:
    n, length = batch or tvm.tirx.Var("n", "int64"), tvm.tirx.Var("l", "int64")
    x = relax.Var("x", relax.TensorType((n, channels, length), dtype))
    w = relax.Var("w", relax.TensorType((out, channels // groups, kernel), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.conv1d(x, w, strides=stride, padding=padding,
                                                  dilation=dilation, groups=groups))
        bb.emit_func_output(y)
    return bb.get()


def _ops(mod: tvm.IRModule) -> list[str]:
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and hasattr(expr.op, "name"):
            found.append(expr.op.name)

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def test_a_conv_becomes_windows_and_a_matmul():
    after = Conv1dAsMatmul()(_conv_module(16, 8, 3, stride=2))
    ops = _ops(after)
    assert "relax.nn.conv1d" not in ops
    assert ops.count("relax.call_tir") == 1 and ops.count("relax.matmul") == 1
    (windows,) = [b.value for b in after["main"].body.blocks[0].bindings
                  if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]
    assert windows.args[0].name_hint == "conv_windows"
    assert int(windows.ty.shape.values[-1]) == 3 * 16  # rows of (channel, kernel tap)


def test_grouped_conv_is_a_matmul_batched_over_groups():
    after = Conv1dAsMatmul()(_conv_module(32, 16, 8, groups=4, padding=4))
    (matmul,) = [b.value for b in after["main"].body.blocks[0].bindings
                 if isinstance(b.value, relax.Call) and b.value.op.name == "relax.matmul"]
    assert [int(d) for d in matmul.ty.shape.values[::2]] == [4, 16 // 4]
    assert all(a.ty.ndim == 3 for a in matmul.args)  # OffloadMatmul's batched form


def test_short_reductions_and_other_layouts_stay_convs():
    short = _conv_module(1, 8, MIN_REDUCTION - 1)  # 1 channel by kernel 31
    assert "relax.nn.conv1d" in _ops(Conv1dAsMatmul()(short))
    integer = _conv_module(16, 8, 3, dtype="int32")
    assert "relax.nn.conv1d" in _ops(Conv1dAsMatmul()(integer))


@pytest.mark.parametrize("channels,out,kernel,groups,stride,padding,dilation", [
    (16, 8, 3, 1, 2, 0, 1),     # a feature-extractor layer
    (32, 16, 8, 4, 1, 4, 1),    # grouped, "same" padding
    (16, 12, 5, 2, 3, 2, 2),    # dilated, strided, grouped
])
def test_rewritten_conv_equals_numpy(channels, out, kernel, groups, stride, padding, dilation):
    mod = Conv1dAsMatmul()(_conv_module(channels, out, kernel, groups, stride, padding, dilation))
    assert "relax.nn.conv1d" not in _ops(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    rng = np.random.default_rng(channels + kernel)
    for batch, length in ((1, 40), (2, 57), (3, 2 * dilation * (kernel - 1) + 1)):
        x = rng.standard_normal((batch, channels, length)).astype(np.float32)
        w = rng.standard_normal((out, channels // groups, kernel)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        # numpy's dilation: the kernel spread with zeros between its taps
        spread = np.zeros((out, channels // groups, dilation * (kernel - 1) + 1), np.float32)
        spread[:, :, ::dilation] = w
        want = conv1d_numpy(x, spread, stride, padding, groups)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_static_batch_of_one_equals_numpy():
    """A batch known to be 1 takes the window's batch index as the constant 0, typed as
    the row index (``windows`` read a PrimExpr's ``.dtype``, which TVM 0.27 lacks: the
    rewrite crashed)."""
    mod = Conv1dAsMatmul()(_conv_module(16, 8, 3, stride=2, batch=1))
    assert "relax.nn.conv1d" not in _ops(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    rng = np.random.default_rng(1)
    for length in (3, 40, 3):
        x = rng.standard_normal((1, 16, length)).astype(np.float32)
        w = rng.standard_normal((8, 16, 3)).astype(np.float32)
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
        np.testing.assert_allclose(got, conv1d_numpy(x, w, 2, 0, 1), rtol=1e-4, atol=1e-4)


def test_conv_stack_through_the_cpu_pipeline_with_the_pass_equals_numpy(tmp_path):
    """The Wav2Vec2-like front end (``models.conv_stack``) with its convs rewritten, then
    grape's llvm build: each batch and length's outputs equal numpy's. As on CUDA,
    ``SliceIntoConvPadding`` first: the grouped conv's "same" padding of an even kernel
    becomes uneven padding (8 left, 7 right) before the rewrite."""
    assert CONV_STACK["groups"] > 1 and CONV_STACK["pos_kernel"] % 2 == 0
    mod = Conv1dAsMatmul()(SliceIntoConvPadding()(conv_stack()))
    assert _ops(mod).count("relax.nn.conv1d") == 1  # the 1-channel first layer stays
    module = grape_tvm.build(mod, {"samples": (400, 4000), "b": (1, 2)}, "llvm",
                             output_names=["feat", "pos"])
    executor = load(module.export(tmp_path / "conv_stack.grape"), "cpu")
    weights = conv_stack_weights()
    rng = np.random.default_rng(3)
    for batch, samples in ((1, 400), (2, 1601), (1, 4000)):
        x = rng.standard_normal((batch, samples)).astype(np.float32)
        got = executor.run({"x": x, **weights})
        want_feat, want_pos = conv_stack_numpy(x, weights)
        np.testing.assert_allclose(got["feat"], want_feat, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got["pos"], want_pos, rtol=1e-4, atol=1e-4)
    executor.close()


def test_cuda_pipeline_gives_the_convs_to_cublaslt():
    module = grape_tvm.build(conv_stack(), {"samples": (400, 16000), "b": (1, 2)}, CUDA,
                             output_names=["feat", "pos"], prebuild_cubin=False)
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert sum(k.startswith("conv_windows") for k in kernels) == 3
    assert "grape.cublaslt.batched_matmul_nt" in kernels  # the grouped conv
    assert sum(k.startswith("grape.cublaslt.matmul") for k in kernels) == 2
    # The weights are read as they are: no kernel reorders one (a transpose and a reshape).
    assert not [k for k in kernels if "transpose" in k and "reshape" in k]
    assert not module.plan["host_steps"]
    tvm_only = grape_tvm.build(conv_stack(), {"samples": (400, 16000), "b": (1, 2)}, CUDA,
                               output_names=["feat", "pos"], prebuild_cubin=False, matmul="tvm")
    assert not any(k.startswith("conv_windows") for r in tvm_only.plan["regions"]
                   for k in r["kernels"])
