"""Matmuls as cuBLASLt calls (``OffloadMatmul``), on the IR, and what the runtime reads back
of a captured library kernel. The calls themselves run on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import grape_tvm
from grape_tvm.passes.library_matmul import OffloadMatmul
from grape_tvm.runtime import cublaslt
from grape_tvm.runtime.cuda_graph import fields_of, parameter_buffer

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


@I.ir_module
class Layer:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((64, 32), "float32"),
             b: R.Tensor((32,), "float32"), wt: R.Tensor((16, 32), "float32"),
             r: R.Tensor(("n", 16), "float32")):
        with R.dataflow():
            h = R.nn.gelu_tanh(R.add(R.matmul(x, w), b))     # bias and GELU epilogue
            h = R.nn.relu(h)                                 # NaN kept: TVM's kernel
            y = R.add(R.matmul(h, R.permute_dims(wt)), r)    # transposed weight; residual
            s = R.matmul(y, R.permute_dims(y))               # two activations: TVM's
            R.output(y, s)
        return (y, s)


def _calls(mod) -> list[str]:
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call):
            op = expr.op
            if getattr(op, "name", "") == "relax.call_dps_packed":
                found.append(expr.args[0].global_symbol)
            elif hasattr(op, "name"):
                found.append(op.name)

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def test_offload_rewrites_weight_matmuls_with_their_epilogues():
    calls = _calls(OffloadMatmul()(Layer))
    assert "grape.cublaslt.matmul_bias_gelu" in calls
    assert "grape.cublaslt.matmul_residual_nt" in calls  # r of the output's shape: C, beta 1
    assert calls.count("relax.matmul") == 1  # y @ y^T: no weight, stays TVM's
    assert "relax.add" not in calls  # the bias and the residual are both in the calls
    assert "relax.nn.gelu_tanh" not in calls  # fused into the first call
    assert "relax.nn.relu" in calls  # cuBLASLt's ReLU drops NaN: not fused


@I.ir_module
class ExportedMlp:
    """A GPT-2 block's MLP as its ONNX export imports: 2-D matmuls reshaped back to
    (b, 1, N), tanh-GELU written out, the residual added after the reshape."""

    @R.function
    def main(x: R.Tensor(("m", 1, 64), "float32"), w: R.Tensor((64, 256), "float32"),
             b: R.Tensor((256,), "float32"), w2: R.Tensor((256, 64), "float32"),
             b2: R.Tensor((64,), "float32")):
        m = T.int64()
        with R.dataflow():
            x2 = R.reshape(x, R.shape([m, 64]))
            v = R.reshape(R.add(R.matmul(x2, w), b), R.shape([m, 1, 256]))
            inner = R.multiply(R.add(v, R.multiply(R.power(v, R.const(3.0, "float32")),
                                                   R.const(0.044715, "float32"))),
                               R.const(0.7978845608, "float32"))
            g = R.multiply(R.multiply(v, R.const(0.5, "float32")),
                           R.add(R.tanh(inner), R.const(1.0, "float32")))
            g2 = R.reshape(g, R.shape([m, 256]))
            y = R.add(x, R.reshape(R.add(R.matmul(g2, w2), b2), R.shape([m, 1, 64])))
            R.output(y)
        return y


def test_offload_fuses_an_exported_tanh_gelu_and_residual_through_reshapes():
    calls = _calls(OffloadMatmul()(ExportedMlp))
    assert calls.count("grape.cublaslt.matmul_bias_gelu") == 1
    assert calls.count("grape.cublaslt.matmul_bias_residual") == 1
    assert not {"relax.tanh", "relax.power", "relax.add", "relax.matmul"} & set(calls)


def test_a_formula_that_is_not_tanh_gelu_stays_tvms():
    """The same chain with 0.6 for 0.5 (or any other constant off) is not GELU."""
    text = ExportedMlp.script().replace("0.5", "0.6")
    calls = _calls(OffloadMatmul()(tvm.script.from_source(text)))
    assert "grape.cublaslt.matmul_bias_gelu" not in calls
    assert "grape.cublaslt.matmul_bias" in calls and "relax.tanh" in calls


def test_an_fp16_export_of_tanh_gelu_is_fused():
    """An fp16 export holds the formula's constants rounded to fp16 (sqrt(2 / pi) as
    0.79785): still GELU, computed by the epilogue in fp32."""
    text = ExportedMlp.script().replace('"float32"', '"float16"')
    calls = _calls(OffloadMatmul()(tvm.script.from_source(text)))
    assert calls.count("grape.cublaslt.matmul_bias_gelu") == 1
    assert not {"relax.tanh", "relax.power"} & set(calls)


@I.ir_module
class SharedProduct:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((64, 32), "float32"),
             b: R.Tensor((32,), "float32"), r: R.Tensor(("n", 32), "float32")):
        with R.dataflow():
            y = R.add(R.matmul(x, w), b)
            z = R.add(y, r)  # a residual add of a product that is also an output
            R.output(y, z)
        return (y, z)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_product_read_elsewhere_is_not_computed_twice(dtype):
    """Fusing ``+ r`` into a call would leave ``y`` to another call: two matmuls for one.
    So too for the fp16 MLP with a GELU off by a constant: its ``v + 0.0447 v^3`` is not a
    residual of the product ``v``, which three kernels read."""
    shared = tvm.script.from_source(SharedProduct.script().replace('"float32"', f'"{dtype}"'))
    calls = _calls(OffloadMatmul()(shared))
    assert [c for c in calls if c.startswith("grape.")] == ["grape.cublaslt.matmul_bias"]
    assert calls.count("relax.add") == 1
    text = ExportedMlp.script().replace('"float32"', f'"{dtype}"').replace("0.5", "0.6")
    calls = _calls(OffloadMatmul()(tvm.script.from_source(text)))
    assert calls.count("grape.cublaslt.matmul_bias") == 1
    assert calls.count("grape.cublaslt.matmul_bias_residual") == 1  # the second matmul's


@I.ir_module
class BroadcastAdd:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((64, 32), "float32"),
             r: R.Tensor((1, 32), "float32")):
        with R.dataflow():
            y = R.add(R.matmul(x, w), r)  # broadcast: neither a bias (N,) nor a residual
            R.output(y)
        return y


def test_an_add_that_broadcasts_is_not_a_residual():
    calls = _calls(OffloadMatmul()(BroadcastAdd))
    assert "grape.cublaslt.matmul" in calls and "relax.add" in calls
    assert not any("residual" in c for c in calls)


@I.ir_module
class Attention:
    # A head_dim of 80: no kernel of grape's fused attention takes it, so the full build keeps
    # the products for cuBLASLt too.
    @R.function
    def main(q: R.Tensor(("b", 12, 1, 80), "float32"), k: R.Tensor(("b", 12, "p", 80), "float32"),
             v: R.Tensor(("b", 12, "p", 80), "float32"), k1: R.Tensor((1, 12, "p", 80), "float32"),
             k3: R.Tensor(("b", 12, 80, "p"), "float32")):
        with R.dataflow():
            s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))   # q @ k^T: batched, k as stored
            o = R.matmul(R.nn.softmax(s), v)                   # p @ v: batched
            b = R.matmul(q, R.permute_dims(k1, [0, 1, 3, 2]))  # batch dims broadcast: TVM's
            t = R.matmul(q, k3)                                # k stored as k^T: batched
            R.output(o, b, t)
        return (o, b, t)


def test_offload_rewrites_products_of_two_activations_as_batched_calls():
    """Attention's products (the same batch dims on both sides) become strided-batched
    calls, the transpose of k read in place; broadcast batch dims stay TVM's."""
    calls = _calls(OffloadMatmul()(Attention))
    assert calls.count("grape.cublaslt.batched_matmul_nt") == 1
    assert calls.count("grape.cublaslt.batched_matmul") == 2
    assert calls.count("relax.matmul") == 1
    assert calls.count("relax.permute_dims") == 1  # k1's: k's transpose is read in place
    lifted = grape_tvm.build(Attention, {"b": (1, 4), "p": (1, 64)}, CUDA,
                             output_names=["o", "b", "t"], prebuild_cubin=False)
    kernels = [k for r in lifted.plan["regions"] for k in r["kernels"]]
    assert "grape.cublaslt.batched_matmul_nt" in kernels and not lifted.plan["host_steps"]


def test_offload_leaves_other_dtypes_and_shapes_alone():
    @I.ir_module
    class Other:
        @R.function
        def main(x: R.Tensor(("n", 8), "float64"), w: R.Tensor((8, 8), "float64"),
                 x3: R.Tensor(("b", "n", 8), "float32"), w3: R.Tensor((1, 8, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)      # float64: no cuBLASLt function for it here
                z = R.matmul(x3, w3)    # a 3-D weight broadcast over the batch
                R.output(y, z)
            return (y, z)

    assert _calls(OffloadMatmul()(Other)).count("relax.matmul") == 2


def test_library_calls_join_a_graph_region_and_the_plan_names_the_library():
    module = grape_tvm.build(Layer, {"n": (1, 64)}, CUDA, output_names=["y", "s"],
                             prebuild_cubin=False, matmul="cublaslt")
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert "grape.cublaslt.matmul_bias_gelu" in kernels
    assert "grape.cublaslt.matmul_residual_nt" in kernels
    assert module.plan["libraries"] == ["cublaslt"] and module.plan["matmul"] == "cublaslt"
    assert not module.plan["host_steps"]
    default = grape_tvm.build(Layer, {"n": (1, 64)}, CUDA, output_names=["y", "s"],
                              prebuild_cubin=False)
    assert default.plan["libraries"] == ["cublaslt"] and default.plan["matmul"] == "auto"
    tvm_only = grape_tvm.build(Layer, {"n": (1, 64)}, CUDA, output_names=["y", "s"],
                               prebuild_cubin=False, matmul="tvm")
    assert tvm_only.plan["libraries"] == [] and tvm_only.plan["matmul"] == "tvm"


def test_matmul_choice_is_checked():
    with pytest.raises(ValueError, match="needs a CUDA target"):
        grape_tvm.build(Layer, {"n": (1, 64)}, "llvm", matmul="cublaslt")
    with pytest.raises(ValueError, match="matmul must be one of"):
        grape_tvm.build(Layer, {"n": (1, 64)}, CUDA, matmul="cudnn", prebuild_cubin=False)
    assert grape_tvm.build(Layer, {"n": (1, 64)}, "llvm").plan["matmul"] == "tvm"


def test_a_decode_step_uses_cublaslt_and_its_kernels_compile():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from models import gpt2_decode_step, gpt2_output_names  # pylint: disable=import-outside-toplevel

    module = grape_tvm.build(gpt2_decode_step(64, 4, 2), {"past": (1, 64)}, CUDA,
                             output_names=gpt2_output_names(2), matmul="cublaslt")
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert sum(k.startswith("grape.cublaslt.") for k in kernels) >= 8  # 4 per layer at least
    assert module.cubins  # the TVM kernels left, compiled by nvcc here


class _ClusterRefusingLt:
    """cuBLASLt's two calls ``_without_clusters`` makes: the attribute is set in the algo's
    bytes, and the check accepts it, refuses it, or asks ``workspace`` bytes."""

    def __init__(self, refuse: bool, workspace: int):
        self.refuse, self.workspace = refuse, workspace

    def cublasLtMatmulAlgoConfigSetAttribute(self, algo, attribute, value, size):
        ctypes.memmove(ctypes.addressof(algo._obj) + 2 * attribute, value, size.value)
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, a, b, c, d, algo, result):
        result._obj.workspaceSize = self.workspace
        return 15 if self.refuse else 0  # CUBLAS_STATUS_NOT_SUPPORTED


@pytest.mark.parametrize("refuse,workspace,kept", [(False, 4096, True), (True, 0, False),
                                                   (False, cublaslt.WORKSPACE_BYTES + 1, False)])
def test_clusters_are_given_up_only_where_cublaslt_accepts_it(refuse, workspace, kept):
    """``CublasLt._without_clusters``: the 1x1x1 cluster shape is kept, with the workspace
    the check asks, only where ``cublasLtMatmulAlgoCheck`` accepts it within the workspace;
    else the algorithm is restored byte for byte."""
    lt = object.__new__(cublaslt.CublasLt)
    lt.lib, lt.handle = _ClusterRefusingLt(refuse, workspace), None
    lt._layouts_of = lambda *args: (None, None, None)  # pylint: disable=protected-access
    found = cublaslt._Heuristic()  # pylint: disable=protected-access
    for i in range(8):
        found.algo[i] = 0x0101010101010101 * (i + 1)
    found.workspaceSize = 7
    before = bytes(found.algo)
    function = cublaslt.MatmulFunction("bias", transposed_weight=False)
    lt._without_clusters(None, found, function, "float16", None)  # pylint: disable=protected-access
    if kept:
        assert bytes(found.algo) != before and found.workspaceSize == workspace
    else:
        assert bytes(found.algo) == before and found.workspaceSize == 7


class _SplitKLt:
    """cuBLASLt's heuristic as ``_heuristic`` calls it: ``splits`` candidates, best first,
    each with its split-K number in the algo's config (set and read back as the library
    does); ``cublasLtMatmulAlgoCheck`` accepts a changed config or refuses it."""

    def __init__(self, splits, refuse: bool = False):
        self.splits, self.refuse = splits, refuse

    def cublasLtMatmulDescSetAttribute(self, *args):
        return 0

    def cublasLtMatmulPreferenceCreate(self, pref):
        return 0

    def cublasLtMatmulPreferenceSetAttribute(self, *args):
        return 0

    def cublasLtMatmulPreferenceDestroy(self, pref):
        return 0

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, asked, out, count):
        for i, split in enumerate(self.splits[:asked]):
            out[i].algo[0] = i  # which candidate
            out[i].algo[1] = split  # where the config calls below keep it
        count._obj.value = min(len(self.splits), asked)
        return 0

    def cublasLtMatmulAlgoConfigGetAttribute(self, algo, attribute, value, size, written):
        assert attribute == cublaslt._ALGO_CONFIG_SPLITK_NUM  # pylint: disable=protected-access
        value._obj.value = algo._obj[1]
        return 0

    def cublasLtMatmulAlgoConfigSetAttribute(self, algo, attribute, value, size):
        assert attribute == cublaslt._ALGO_CONFIG_SPLITK_NUM  # pylint: disable=protected-access
        algo._obj[1] = value._obj.value
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, a, b, c, d, algo, result):
        result._obj.workspaceSize = 4096
        return 15 if self.refuse else 0  # CUBLAS_STATUS_NOT_SUPPORTED


@pytest.mark.parametrize("k,splits,refuse,chosen,split", [
    (128, [264, 16, 1], False, 2, 1),  # 264 and 16 parts of K = 128: fewer than 16 each
    (128, [1, 264], False, 0, 1),
    (768, [33, 1], False, 0, 33),  # 23 each: the heuristic's first choice kept
    (768, [0xFFFFFFFF, 33], False, 0, 0xFFFFFFFF),  # all ones: an algorithm that never splits
    (128, [264, 66], False, 0, 8),  # none leaves 16 to a part: the first, in 128 // 16 parts
    (128, [264, 66], True, 0, 264),  # ... unless cuBLASLt refuses that: the first as it is
])
def test_a_split_k_finer_than_k_allows_is_passed_over(k, splits, refuse, chosen, split):
    """``CublasLt._heuristic`` takes the best candidate whose split-K parts each sum at least
    ``MIN_K_PER_SPLIT`` of K (the H200's first choice for fp32 M <= 8, K = 128, N = 128 split
    it 264 ways: 53.9 us a call); where none does, the first with fewer parts if cuBLASLt
    accepts them."""
    lt = object.__new__(cublaslt.CublasLt)
    lt.lib, lt.handle = _SplitKLt(splits, refuse), None
    lt._layouts_of = lambda *args: (None, None, None)  # pylint: disable=protected-access
    lt._without_clusters = lambda *args: None  # pylint: disable=protected-access
    function = cublaslt.MatmulFunction("bias", transposed_weight=False)
    problem = cublaslt._Problem(8, k, 128)  # pylint: disable=protected-access
    found = lt._heuristic(None, function, "float32", problem, None)  # pylint: disable=protected-access
    assert (found.algo[0], found.algo[1]) == (chosen, split)


def test_a_wide_parameter_is_patched_word_by_word():
    """cuBLAS's kernels take one struct of hundreds of bytes: the fields a patch writes are
    its 8-byte words (operands' addresses and sizes sit inside it); narrow parameters stay
    whole."""
    assert fields_of([(0, 8), (8, 4), (16, 40)]) == [
        (0, 8), (8, 4), (16, 8), (24, 8), (32, 8), (40, 8), (48, 8)]
    assert fields_of([(0, 16), (16, 20)]) == [(0, 16), (16, 8), (24, 8), (32, 4)]


def test_parameter_buffer_from_extra_and_from_kernel_params():
    """The two ways a captured node holds its parameters (the sm90 cuBLAS kernels use
    ``extra``), read into one buffer laid out by ``cuFuncGetParamInfo``."""
    data = bytes(range(48))
    raw = ctypes.create_string_buffer(data, len(data))
    size = ctypes.c_size_t(len(data))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(raw), 2, ctypes.addressof(size), 0)
    params = SimpleNamespace(extra=ctypes.addressof(extra), kernelParams=0)
    assert parameter_buffer(params, [(0, 48)]) == data
    first, second = ctypes.c_uint64(0x1122334455667788), ctypes.create_string_buffer(b"abcd", 4)
    pointers = (ctypes.c_void_p * 2)(ctypes.addressof(first), ctypes.addressof(second))
    params = SimpleNamespace(extra=0, kernelParams=ctypes.addressof(pointers))
    assert parameter_buffer(params, [(0, 8), (8, 4)]) == \
        (0x1122334455667788).to_bytes(8, "little") + b"abcd"


def test_the_nvidia_cublas_package_is_found_where_pip_put_it(monkeypatch):
    """``pip install 'grape-tvm[cuda]'`` brings libcublasLt in the nvidia-cublas wheel, in a
    folder the loader does not search: the runtime finds it there when no soname loads."""
    packaged = cublaslt._packaged_libraries()  # pylint: disable=protected-access
    if not packaged:
        pytest.skip("nvidia-cublas is not installed here")
    monkeypatch.setattr(cublaslt, "_LIBRARIES", ("libcublasLt.so.nonexistent",))
    library = cublaslt._library()  # pylint: disable=protected-access
    assert library._name == str(packaged[0])  # pylint: disable=protected-access
    assert library.cublasLtGetVersion() > 0



@I.ir_module
class SharedInBranch:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((64, 32), "float32"),
             b: R.Tensor((32,), "float32"), c: R.Tensor((), "bool")):
        if c:
            h = R.add(R.matmul(x, w), b)
            r = R.add(R.nn.relu(h), h)  # h read twice: by relu and as a residual
        else:
            r = R.matmul(x, w)
        return r


def test_a_product_read_elsewhere_inside_a_branch_is_not_computed_twice():
    """The same check inside an ``if``'s branch (left inline when it holds an impure call)."""
    calls = _calls(OffloadMatmul()(SharedInBranch))
    assert "grape.cublaslt.matmul_bias_residual" not in calls
    assert calls.count("grape.cublaslt.matmul_bias") == 1
