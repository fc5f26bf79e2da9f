"""StoreWeightsTransposed (passes/weight_transpose.py): a constant [K, N] weight of a matmul
is stored [N, K] and read through permute_dims; results equal numpy's, and a CUDA build
gives the matmul grape's "nk" GEMV kernels (up to 8 rows) instead of the "kn" one (1 row)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.ir import GenericConst

import grape_tvm
from grape_tvm.artifact import Artifact, ArtifactError
from grape_tvm.loader import entry_argument, load, load_library
from grape_tvm.passes import StoreWeightsTransposed
from grape_tvm.runtime.signature import InputError

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((64, 48)).astype("float32")
W2 = RNG.standard_normal((48, 32)).astype("float32")
BIAS = RNG.standard_normal(48).astype("float32")


def _mlp(shared_elsewhere: bool = False) -> tvm.IRModule:
    """``(x @ W1 + b) @ W2`` with constant weights (``x``: (m, 64)); ``shared_elsewhere``
    also adds W1 to an output (a read that is not a matmul's)."""
    m = tirx.Var("m", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, 64), "float32"))
    op = relax.op
    w1 = relax.const(W1)
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(op.add(op.matmul(x, w1), relax.const(BIAS)))
            outs = [bb.emit(op.matmul(h, relax.const(W2)))]
            if shared_elsewhere:
                outs.append(bb.emit(op.add(w1, w1)))
            out = bb.emit_output(relax.Tuple(outs) if shared_elsewhere else outs[0])
        bb.emit_func_output(out)
    return bb.get()


def _reference(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ W1 + BIAS) @ W2


def _close(got: np.ndarray, want: np.ndarray) -> None:
    """fp32 sums against a float64 reference: 1e-5 of the output's largest magnitude."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _constants(mod: tvm.IRModule) -> list[np.ndarray]:
    found = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e.value.numpy()) if isinstance(e, GenericConst)
        else None)
    return found


def _run(mod: tvm.IRModule, x: np.ndarray):
    ex = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x))


def test_constant_weights_are_stored_transposed_and_read_through_permute_dims():
    after = StoreWeightsTransposed()(_mlp())
    shapes = sorted(c.shape for c in _constants(after) if c.ndim == 2)
    assert shapes == [(32, 48), (48, 64)]  # [N, K] copies; the [K, N] ones are gone
    stored = {c.shape: c for c in _constants(after)}
    np.testing.assert_array_equal(stored[(48, 64)], W1.T)
    assert stored[(48, 64)].flags["C_CONTIGUOUS"]
    permutes = []
    relax.analysis.post_order_visit(
        after["main"], lambda e: permutes.append(e) if isinstance(e, relax.Call) and
        e.op == tvm.ir.Op.get("relax.permute_dims") else None)
    assert len(permutes) == 2


@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_stored_transposed_weights_give_the_same_results(m):
    x = RNG.standard_normal((m, 64)).astype("float32")
    got = _run(StoreWeightsTransposed()(_mlp()), x).numpy()
    _close(got, _reference(x))


def test_a_constant_read_by_anything_else_keeps_its_layout():
    after = StoreWeightsTransposed()(_mlp(shared_elsewhere=True))
    shapes = sorted(c.shape for c in _constants(after) if c.ndim == 2)
    assert set(shapes) == {(32, 48), (64, 48)}  # W2 transposed, W1 as it was
    x = RNG.standard_normal((5, 64)).astype("float32")
    y, doubled = _run(after, x)
    _close(y.numpy(), _reference(x))
    np.testing.assert_array_equal(doubled.numpy(), W1 + W1)


def test_a_weight_two_matmuls_read_is_transposed_once():
    square = RNG.standard_normal((48, 48)).astype("float32")
    m = tirx.Var("m", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, 48), "float32"))
    w = relax.const(square)
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(bb.emit(relax.op.matmul(h, w)))
        bb.emit_func_output(out)
    after = StoreWeightsTransposed()(bb.get())
    found = []
    relax.analysis.post_order_visit(
        after["main"], lambda e: found.append(e) if isinstance(e, GenericConst) else None)
    assert len(found) == 2 and found[0].same_as(found[1])  # one [N, K] copy, read twice
    stored = found[0].value.numpy()
    np.testing.assert_array_equal(stored, square.T)
    xv = RNG.standard_normal((4, 48)).astype("float32")
    _close(_run(after, xv).numpy(), xv.astype(np.float64) @ square @ square)


def test_a_cuda_build_gives_constant_weights_the_nk_gemv_kernels():
    """Before the pass, a constant [K, N] weight took the "kn" GEMV kernel at one row and
    cuBLASLt above; stored [N, K], it takes the "nk" kernels up to 8 rows."""
    module = grape_tvm.build(_mlp(), {"m": (1, 64)}, CUDA, output_names=["y"],
                             prebuild_cubin=False)
    assert module.plan["gemv_rows"] == {"grape.cublaslt.matmul_bias_nt": [1, 2, 4, 8],
                                        "grape.cublaslt.matmul_nt": [1, 2, 4, 8]}


# -- weights that are inputs, bound once ---------------------------------------------------

def _mlp_of_inputs(extra_read: bool = False) -> tvm.IRModule:
    """``(x @ w1 + b) @ w2`` with w1, w2 and b inputs; ``extra_read`` also returns w2 + w2."""
    m = tirx.Var("m", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, 64), "float32"))
    w1 = relax.Var("w1", relax.TensorType((64, 48), "float32"))
    b = relax.Var("b", relax.TensorType((48,), "float32"))
    w2 = relax.Var("w2", relax.TensorType((48, 32), "float32"))
    op = relax.op
    with bb.function("main", [x, w1, b, w2]):
        with bb.dataflow():
            h = bb.emit(op.add(op.matmul(x, w1), b))
            outs = [bb.emit(op.matmul(h, w2))]
            if extra_read:
                outs.append(bb.emit(op.add(w2, w2)))
            out = bb.emit_output(relax.Tuple(outs) if extra_read else outs[0])
        bb.emit_func_output(out)
    return bb.get()


def test_named_weight_inputs_are_taken_transposed():
    after = StoreWeightsTransposed([1, 2, 3])(_mlp_of_inputs(extra_read=True))  # w1, b, w2
    main = after["main"]
    shapes = {p.name: [int(d) if isinstance(d, tirx.IntImm) else str(d)
                       for d in p.ty.shape.values] for p in main.params}
    # w1 only feeds a matmul: taken [N, K]; w2 is read by an add too, b is no matmul weight
    assert shapes == {"x": ["m", 64], "w1": [48, 64], "b": [48], "w2": [48, 32]}
    assert [int(i) for i in main.attrs["grape.transposed_inputs"]] == [1]
    # not named: as the model has it
    untouched = StoreWeightsTransposed()(_mlp_of_inputs())
    tvm.ir.assert_structural_equal(untouched, _mlp_of_inputs())
    # constants=False (the CPU, matmul="tvm"): constants as they are
    tvm.ir.assert_structural_equal(StoreWeightsTransposed(constants=False)(_mlp()), _mlp())


def _bound_module(target: str = "llvm", weights=("w1", "w2")):
    return grape_tvm.build(_mlp_of_inputs(), {"m": (1, 64)}, target, output_names=["y"],
                           weights=list(weights), prebuild_cubin=False)


def test_bound_weights_are_transposed_once_and_give_the_same_results(tmp_path):
    module = _bound_module()
    assert module.plan["transposed_inputs"] == ["w1", "w2"]
    assert [t.shape for t in module.signature.inputs if t.name == "w1"] == [(64, 48)]
    with load(module.export(tmp_path / "mlp.grape"), "cpu") as executor:
        executor.bind_inputs({"w1": W1, "b": BIAS, "w2": W2})  # as the model declares them
        # each copied once, transposed on the host on its way
        assert executor.stats.h2d_bytes == W1.nbytes + BIAS.nbytes + W2.nbytes
        for m in (1, 3, 8, 17, 64):
            x = RNG.standard_normal((m, 64)).astype("float32")
            _close(executor.run({"x": x})["y"], _reference(x))
        # a bound weight bound again (a new model version): transposed again
        executor.bind_inputs({"w2": 2 * W2})
        x = RNG.standard_normal((5, 64)).astype("float32")
        _close(executor.run({"x": x})["y"], 2 * _reference(x))
    with load(tmp_path / "mlp.grape", "cpu") as executor:
        with pytest.raises(InputError, match="'w1' is a weight this build reads transposed"):
            executor.run({"x": np.zeros((2, 64), "float32"), "w1": W1, "b": BIAS, "w2": W2})
        # record_all stands zeros for unbound inputs, not for these (it said "do not pass")
        with pytest.raises(InputError, match=r"record_all: bind \['w1', 'w2'\] first"):
            executor.record_all({"m": [1, 2]}, progress=False)
        executor.bind_inputs({"w1": W1, "w2": W2})
        executor.record_all({"m": [1, 2]}, progress=False)
        x = RNG.standard_normal((2, 64)).astype("float32")
        _close(executor.run({"x": x, "b": BIAS})["y"], _reference(x))


def test_weights_must_name_inputs():
    with pytest.raises(ValueError, match=r"weights names \['w3'\], which the model does not"):
        _bound_module(weights=("w1", "w3"))
    with pytest.raises(TypeError, match="a list of input names"):
        grape_tvm.build(_mlp_of_inputs(), {"m": (1, 64)}, "llvm", weights="w1")


def test_a_cuda_build_gives_bound_weights_the_nk_gemv_kernels():
    module = _bound_module(CUDA)
    assert module.plan["transposed_inputs"] == ["w1", "w2"]
    assert module.plan["gemv_rows"] == {"grape.cublaslt.matmul_bias_nt": [1, 2, 4, 8],
                                        "grape.cublaslt.matmul_nt": [1, 2, 4, 8]}


def test_loop_state_and_onnx_loops_take_no_weights():
    import sys  # pylint: disable=import-outside-toplevel
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from models import DECODER_TINY, decoder_state_names, decoder_step  # pylint: disable=import-outside-toplevel

    carried = decoder_state_names(DECODER_TINY["layers"])
    with pytest.raises(ValueError, match=r"weights \['k0'\] are loop state"):
        grape_tvm.compile_loop(decoder_step(**DECODER_TINY), carried, max_steps=4,
                               dims={"batch": (1, 2)}, weights=["k0", "w_qkv0"])
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_onnx_loop import DIMS, affine_loop  # pylint: disable=import-outside-toplevel

    with pytest.raises(ValueError, match="not supported for a model whose computing node is a Loop"):
        grape_tvm.compile_onnx(affine_loop(), dims=DIMS, weights=["w"])


def test_an_artifact_naming_a_weight_it_does_not_take_is_refused(tmp_path):
    path = _bound_module().export(tmp_path / "mlp.grape")
    artifact = Artifact.load(path)
    for wrong in (["w9"], ["x"]):  # not an input; an input of symbolic shape
        artifact.manifest["plan"]["transposed_inputs"] = wrong
        artifact.save(tmp_path / "edited.grape")
        with pytest.raises(ArtifactError, match="not inputs of static 2-D shape"):
            load(tmp_path / "edited.grape", "cpu")


def test_the_raw_vm_takes_transposed_weights_from_entry_argument(tmp_path):
    """A caller of TVM's VM on the artifact's library (the benchmarks' baselines) passes
    each weight through ``entry_argument``: transposed where the plan says, as it is else."""
    library, manifest, dev = load_library(_bound_module().export(tmp_path / "mlp.grape"), "cpu")
    vm = relax.VirtualMachine(library, dev)
    x = RNG.standard_normal((6, 64)).astype("float32")
    named = {"x": x, "w1": W1, "b": BIAS, "w2": W2}
    args = [entry_argument(manifest, name, value, dev) for name, value in named.items()]
    assert args[0] is x and args[2] is BIAS  # not weights the build transposed
    got = vm["main"](*[a if isinstance(a, tvm.runtime.Tensor) else tvm.runtime.tensor(a, dev)
                       for a in args])
    _close(got.numpy(), _reference(x))
