"""``GemvForFewRows``: a cuBLASLt matmul with few rows on grape's GEMV kernels, the library
above, on the IR and in what the dispatch computes. The kernels and the library calls run
on the GPU (tests/test_gpu.py, ``test_few_rows_on_gemv_kernels_and_cublaslt_above...``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T
from tvm_ffi.structural import structural_walk

import grape_tvm
from grape_tvm.passes.few_rows_gemv import (GEMV_ROWS, LIBRARY_FUNCTION_ATTR, GemvForFewRows,
                                            few_rows_gemv, matmul_prim_func)
from grape_tvm.passes.library_matmul import OffloadMatmul
from grape_tvm.runtime.cublaslt import MATMUL_FUNCTIONS

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


@I.ir_module
class Layer:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((64, 128), "float32"),
             b: R.Tensor((128,), "float32"), wt: R.Tensor((64, 128), "float32"),
             r: R.Tensor(("n", 64), "float32")):
        with R.dataflow():
            h = R.nn.gelu_tanh(R.add(R.matmul(x, w), b))     # [K, N]: bias, GELU
            y = R.add(R.matmul(h, R.permute_dims(wt)), r)    # [N, K]: residual
            R.output(y)
        return y


def _lowered(mod):
    with CUDA:
        return GemvForFewRows()(OffloadMatmul()(mod))


def _bounds(func: tirx.PrimFunc) -> list[int]:
    """The row bounds a dispatch tests on the host (``tvm_thread_invariant(m <= b)``)."""
    found = []

    def visit(node):
        found.append(int(node.condition.args[0].b))

    structural_walk(func.body, ((tirx.IfThenElse, visit),))
    return sorted(found)


def test_library_calls_become_gemv_kernels_for_few_rows_and_the_library_above():
    lowered = _lowered(Layer)
    prims = {gv.name_hint: f for gv, f in lowered.functions_items()
             if isinstance(f, tirx.PrimFunc)}
    assert sorted(prims) == ["matmul_bias_gelu_gemv", "matmul_residual_nt_gemv"]
    for name, layout in (("matmul_bias_gelu_gemv", "kn"), ("matmul_residual_nt_gemv", "nk")):
        func = prims[name]
        library = "grape.cublaslt." + name[:-len("_gemv")]
        assert str(func.attrs[LIBRARY_FUNCTION_ATTR]) == library
        assert func.attrs["tirx.is_scheduled"]
        assert "global_symbol" not in func.attrs
        assert _bounds(func) == [0, *GEMV_ROWS[layout]]  # M = 0: the library's, no launch
        assert func.script().count(f'T.call_packed("{library}"') == 2  # and above the last
    calls = [b.value for b in lowered["main"].body.blocks[0].bindings]
    assert all(c.op.name == "relax.call_tir" for c in calls)


def test_static_rows_above_the_buckets_stay_the_librarys_and_few_get_one_kernel():
    def layer(rows):
        @I.ir_module
        class Static:
            @R.function
            def main(x: R.Tensor((rows, 64), "float32"), w: R.Tensor((128, 64), "float32")):
                with R.dataflow():
                    y = R.matmul(x, R.permute_dims(w))
                    R.output(y)
                return y

        return Static

    many = _lowered(layer(64))
    assert [b.value.op.name for b in many["main"].body.blocks[0].bindings] == \
        ["relax.call_dps_packed"]
    few = _lowered(layer(3))
    (func,) = [f for _, f in few.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert _bounds(func) == [] and "call_packed" not in func.script()
    assert LIBRARY_FUNCTION_ATTR not in func.attrs  # one GEMV kernel, no library call


def test_other_targets_and_other_calls_are_left_alone():
    offloaded = OffloadMatmul()(Layer)
    with tvm.target.Target("llvm"):
        assert GemvForFewRows()(offloaded).same_as(offloaded)

    @I.ir_module
    class Batched:  # attention's products: two activations, cuBLASLt's alone
        @R.function
        def main(q: R.Tensor(("b", 4, 1, 16), "float32"), k: R.Tensor(("b", 4, "p", 16), "float32")):
            with R.dataflow():
                s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))
                R.output(s)
            return s

    lowered = _lowered(Batched)
    assert [b.value.op.name for b in lowered["main"].body.blocks[0].bindings] == \
        ["relax.call_dps_packed"]


def _reference(function, x, w, bias, residual):
    v = x.astype(np.float64) @ (w.T if function.transposed_weight else w).astype(np.float64)
    if residual is not None:
        v = v + residual
    if bias is not None:
        v = v + bias
    if "gelu" in function.epilogue:
        v = 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
    return v


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", sorted(n for n, f in MATMUL_FUNCTIONS.items() if not f.batched))
def test_what_the_gemv_kernels_compute_equals_the_library_functions_meaning(name, dtype):
    """``matmul_prim_func`` (the computation the GEMV kernels are schedules of), built for
    the CPU, against numpy in float64 at several row counts: the epilogue in cuBLASLt's
    order (residual and bias added, then GELU), summed and finished in fp32, rounded once
    (fp16: within one fp16 rounding of the float64 result)."""
    function = MATMUL_FUNCTIONS[name]
    m = tirx.Var("m", "int64")
    k, n = 48, 40
    lib = tvm.compile(tvm.IRModule({"main": matmul_prim_func(function, [m], k, n, dtype)}),
                      target="llvm")
    rng = np.random.default_rng(0)
    rtol = 1e-5 if dtype == "float32" else 1e-3
    for rows in (1, 5, 33):
        x = rng.standard_normal((rows, k)).astype(dtype)
        w = rng.standard_normal((n, k) if function.transposed_weight else (k, n)).astype(dtype)
        bias = rng.standard_normal(n).astype(dtype) if function.has_bias else None
        residual = rng.standard_normal((rows, n)).astype(dtype) if function.residual else None
        args = [a for a in (x, w, bias, residual) if a is not None]
        out = tvm.runtime.tensor(np.zeros((rows, n), dtype))
        lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
        want = _reference(function, x, w, bias, residual)
        np.testing.assert_allclose(out.numpy().astype(np.float64), want, rtol=rtol,
                                   atol=rtol * np.abs(want).max())


def test_auto_is_the_cuda_default_and_the_plan_says_what_took_the_gemv_kernels():
    module = grape_tvm.build(Layer, {"n": (1, 64)}, CUDA, output_names=["y"],
                             prebuild_cubin=False)
    assert module.plan["matmul"] == "auto" and module.plan["libraries"] == ["cublaslt"]
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert kernels == ["grape.cublaslt.matmul_bias_gelu", "grape.cublaslt.matmul_residual_nt"]
    assert not module.plan["host_steps"]
    # what GemvForFewRows rewrote, from the lowered module (cuBLASLt alone has none)
    assert module.plan["gemv_rows"] == {"grape.cublaslt.matmul_bias_gelu": [1],
                                        "grape.cublaslt.matmul_residual_nt": [1, 2, 4, 8]}
    alone = grape_tvm.build(Layer, {"n": (1, 64)}, CUDA, output_names=["y"],
                            prebuild_cubin=False, matmul="cublaslt")
    assert alone.plan["gemv_rows"] == {}
    with pytest.raises(ValueError, match="needs a CUDA target"):
        grape_tvm.build(Layer, {"n": (1, 64)}, "llvm", matmul="auto")
    # inspect says which rows run on which implementation, from the artifact alone
    from grape_tvm.cli import describe  # pylint: disable=import-outside-toplevel

    def said(plan):
        return describe({"target": {"kind": "cuda"}, "plan": plan,
                         "signature": module.signature.to_json()})["matmul"]

    assert said(module.plan).startswith("grape's GEMV kernels")
    assert "grape.cublaslt.matmul_residual_nt: M <= 8" in said(module.plan)
    assert "grape.cublaslt.matmul_bias_gelu: M <= 1" in said(module.plan)
    assert said(alone.plan).startswith("cuBLASLt")


def test_static_rows_within_the_buckets_need_no_library():
    @I.ir_module
    class Few:
        @R.function
        def main(x: R.Tensor((3, 64), "float32"), w: R.Tensor((128, 64), "float32")):
            with R.dataflow():
                y = R.matmul(x, R.permute_dims(w))
                R.output(y)
            return y

    module = grape_tvm.build(Few, {}, CUDA, output_names=["y"], prebuild_cubin=False)
    assert module.plan["libraries"] == [] and module.plan["gemv_rows"] == {}
    assert [k for r in module.plan["regions"] for k in r["kernels"]] == ["matmul_nt_gemv"]


def test_every_gemv_kernel_sums_its_threads_partials():
    """Regression: with the rows int64 and K, N int32 (te's default for Python ints), TVM's
    cross-thread reduction left each output summed by one thread of its group, the other
    partials dropped (wrong results on the H200 at every M in the GEMV buckets). The
    computation is int64 throughout, as Relax's legalization writes it: each GEMV kernel of
    the dispatch ends in a warp-shuffle sum of its group."""
    function = MATMUL_FUNCTIONS["grape.cublaslt.matmul_bias"]
    func = matmul_prim_func(function, [tirx.Var("n", "int64")], 64, 64, "float32")
    assert all(str(d.ty) == "int64" for p in func.params for d in p.ty.shape)
    with CUDA:
        dispatch = few_rows_gemv(function, func, CUDA)
    source = tvm.compile(tvm.IRModule({"main": dispatch.with_attr("global_symbol", "main")}),
                         target=CUDA).mod.imports[0].inspect_source()
    kernels = source.split('extern "C" __global__')[1:]
    bodies = [k for k in kernels if "{" in k.split(";")[0]]  # definitions, not declarations
    assert len(bodies) == len(GEMV_ROWS["kn"])
    assert all("__shfl_down_sync" in body for body in bodies)


def test_the_gemv_rule_declines_iters_of_mixed_index_dtypes():
    """What the regression above came from, refused where it starts: ``match_gemv`` takes
    no matmul whose iters mix int32 and int64 (its kernels would sum wrongly)."""
    from tvm import te  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.gemv_schedule import match_gemv  # pylint: disable=import-outside-toplevel

    n = tirx.Var("n", "int64")
    x, w = te.placeholder((n, 64), "float32", "x"), te.placeholder((64, 32), "float32", "w")
    k = te.reduce_axis((0, 64), name="k")
    y = te.compute((n, 32), lambda i, j: te.sum(x[i, k] * w[k, j], axis=k), name="y")
    assert match_gemv(te.create_prim_func([x, w, y])) is None
    function = MATMUL_FUNCTIONS["grape.cublaslt.matmul"]
    assert match_gemv(matmul_prim_func(function, [n], 64, 32, "float32")) is not None


def _legalized(op, *shapes) -> tirx.PrimFunc:
    """The PrimFunc TVM legalizes ``op`` over fp32 inputs of ``shapes`` into."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    m = tirx.Var("m", "int64")
    params = [relax.Var(f"a{i}", relax.TensorType([m if d == "m" else d for d in shape],
                                                  "float32"))
              for i, shape in enumerate(shapes)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        out = bb.emit(op(*params))
        bb.emit_func_output(out)
    legalized = relax.transform.LegalizeOps()(bb.get())
    (func,) = [f for f in legalized.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def test_an_element_wise_kernel_of_one_input_is_a_scalar_function():
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.few_rows_gemv import unary_elementwise

    assert unary_elementwise(_legalized(relax.op.nn.gelu, ("m", 40))) is not None
    assert unary_elementwise(_legalized(relax.op.add, ("m", 40), ("m", 40))) is None
    assert unary_elementwise(_legalized(lambda a: relax.op.sum(a, axis=[1]), ("m", 40))) is None
    assert unary_elementwise(_legalized(relax.op.permute_dims, (40, 40))) is None
    # tril's value uses the element's position: no scalar function of the value alone (a
    # review found it taken, and the matmul's kernel built with unbound variables)
    assert unary_elementwise(_legalized(relax.op.tril, (40, 40))) is None


def test_an_erf_gelu_joins_the_gemv_epilogue_and_equals_numpy():
    """``matmul_prim_func`` with the erf GELU ``unary_elementwise`` reads from TVM's
    legalized ``nn.gelu``, built for the CPU: numpy's matmul, bias and erf GELU."""
    import math  # pylint: disable=import-outside-toplevel

    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.few_rows_gemv import unary_elementwise

    function = MATMUL_FUNCTIONS["grape.cublaslt.matmul_bias_nt"]
    gelu = unary_elementwise(_legalized(relax.op.nn.gelu, ("m", 40)))
    m = tirx.Var("m", "int64")
    k, n = 48, 40
    lib = tvm.compile(tvm.IRModule({"main": matmul_prim_func(function, [m], k, n, "float32",
                                                             gelu)}), target="llvm")
    rng = np.random.default_rng(1)
    for rows in (1, 7):
        x, w = rng.standard_normal((rows, k)), rng.standard_normal((n, k))
        bias = rng.standard_normal(n)
        out = tvm.runtime.tensor(np.zeros((rows, n), "float32"))
        lib["main"](*[tvm.runtime.tensor(a.astype("float32")) for a in (x, w, bias)], out)
        v = x.astype("float32").astype(np.float64) @ w.astype("float32").T.astype(np.float64) + \
            bias.astype("float32")
        want = 0.5 * v * (1 + np.frompyfunc(math.erf, 1, 1)(v / math.sqrt(2)).astype(np.float64))
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@I.ir_module
class ErfLayer:
    @R.function
    def main(x: R.Tensor(("n", 64), "float32"), w: R.Tensor((128, 64), "float32"),
             b: R.Tensor((128,), "float32")):
        with R.dataflow():
            h = R.nn.gelu(R.add(R.matmul(x, R.permute_dims(w)), b))  # no cuBLASLt epilogue
            R.output(h)
        return h


def test_an_erf_gelu_after_a_library_matmul_is_no_kernel_of_its_own():
    """Built for CUDA (the default matmul): the GELU is in the matmul's kernel function,
    fused into its GEMV kernels and run after cuBLASLt above them; before, it was a kernel
    of its own after the call."""
    from grape_tvm.compiler import _lower  # pylint: disable=import-outside-toplevel

    module = grape_tvm.build(ErfLayer, {"n": (1, 64)}, CUDA, output_names=["h"])
    kernels = [k for r in module.plan["regions"] for k in r["kernels"]]
    assert kernels == ["grape.cublaslt.matmul_bias_nt"], kernels
    lowered = _lower(ErfLayer, CUDA, {"n": (1, 64)})
    (fused,) = [g.name_hint for g, f in lowered.functions_items()
                if isinstance(f, tirx.PrimFunc) and g.name_hint.endswith("_gemv")]
    assert "gelu" in fused
    assert not [g for g in lowered.get_global_vars() if g.name_hint.startswith("gelu")]
    # the GEMV kernel of each of the 4 buckets and the kernel after cuBLASLt's compute it
    assert lowered[fused].script().count("T.erf(") == 5


@T.prim_func(private=True, s_tir=True)
def _double(var_x: T.handle):
    T.func_attr({"tirx.noalias": True})
    n = T.int64()
    x = T.match_buffer(var_x, (n, T.int64(64)), "float32")
    for i, j in T.grid(n, T.int64(64)):
        with T.sblock("double"):
            vi, vj = T.axis.remap("SS", [i, j])
            x[vi, vj] = x[vi, vj] * T.float32(2)


def test_a_fused_activation_leaves_the_matmul_where_it_was():
    """x doubled in place between the matmul and its GELU: the fused matmul still reads x
    before the doubling (a review found it emitted at the GELU, after it)."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    n = tirx.Var("n", "int64")
    x_type = relax.TensorType((n, 64), "float32")
    x, w = relax.Var("x", x_type), relax.Var("w", relax.TensorType((128, 64), "float32"))
    bb = relax.BlockBuilder()
    double = bb.add_func(_double, "double")
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            doubled = bb.emit_output(relax.call_tir_inplace(double, [x], 0, x_type))
            h = bb.emit_output(relax.op.nn.gelu(y))
        bb.emit_func_output(relax.Tuple([h, doubled]))
    with CUDA:
        out = GemvForFewRows()(relax.transform.LegalizeOps()(OffloadMatmul()(bb.get())))
    called = [b.value.args[0].name_hint for b in out["main"].body.blocks[0].bindings]
    assert called == ["matmul_nt_gelu_gemv", "double"], called


def _norm_layer(width: int = 256, both: bool = False, written: bool = False):
    """``y = layer_norm(x) @ w^T`` (w stored [N, K]); ``both``: the norm's output is an
    output too; ``written``: x's first row written in place between the norm and the
    matmul."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    n = tirx.Var("n", "int64")
    x_type = relax.TensorType((n, width), "float32")
    x = relax.Var("x", x_type)
    g, b = (relax.Var(name, relax.TensorType((width,), "float32")) for name in ("g", "b"))
    w = relax.Var("w", relax.TensorType((128, width), "float32"))
    bb = relax.BlockBuilder()
    write_row = bb.add_func(_row_write(width), "write_row")
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            outputs = [normed] if both else []
            if written:
                outputs.append(bb.emit(relax.call_tir_inplace(write_row, [x, b], 0, x_type)))
            y = bb.emit(relax.op.matmul(normed, relax.op.permute_dims(w)))
            out = bb.emit_output(relax.Tuple([y, *outputs]) if outputs else y)
        bb.emit_func_output(out)
    return bb.get()


def _row_write(width: int):
    @T.prim_func(private=True, s_tir=True)
    def write_row(var_x: T.handle, row: T.Buffer((T.int64(width),), "float32")):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, T.int64(width)), "float32")
        for j in range(T.int64(width)):
            with T.sblock("write"):
                vj = T.axis.remap("S", [j])
                x[T.int64(0), vj] = row[vj]

    return write_row


def _kernel_names(mod) -> list[str]:
    return [g.name_hint for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize("width", [256, 96])
def test_a_layer_norm_before_a_library_matmul_is_no_kernel_of_its_own(width):
    """Built for CUDA: the norm joins the matmul's kernel function, whose one-row GEMV
    kernel computes its statistics and normalizes x as it reads it (a row of 96: fewer
    elements than the block's threads), and which for more rows runs the norm's kernel
    into a second output that a GEMV kernel or cuBLASLt reads."""
    from grape_tvm.compiler import _lower  # pylint: disable=import-outside-toplevel

    mod = _norm_layer(width)
    module = grape_tvm.build(mod, {"n": (1, 64)}, CUDA, output_names=["y"],
                             prebuild_cubin=False)
    assert [k for r in module.plan["regions"] for k in r["kernels"]] == \
        ["grape.cublaslt.matmul_nt"]
    lowered = _lower(mod, CUDA, {"n": (1, 64)})
    assert "layer_norm" not in _kernel_names(lowered)
    (fused,) = [name for name in _kernel_names(lowered) if name.endswith("_gemv")]
    assert fused == "matmul_nt_layer_norm_gemv"
    func = lowered[fused]
    assert _bounds(func) == [0, *GEMV_ROWS["nk"]]
    assert func.script().count('T.call_packed("grape.cublaslt.matmul_nt"') == 2
    # x, g, b, w, then the call's two outputs: the norm's and y
    names = [p.name for p in func.params]
    assert len(names) == 6 and names[4] == "normed", names


@pytest.mark.parametrize("case", ["read_twice", "written_between"])
def test_a_layer_norm_stays_a_kernel_where_it_cannot_join(case):
    """Its output read besides the matmul; its input written in place between the two (the
    matmul's kernel would read it late): the norm keeps its kernel, and the matmul still
    gets its GEMV kernels."""
    from grape_tvm.compiler import _lower  # pylint: disable=import-outside-toplevel

    mod = _norm_layer(both=case == "read_twice", written=case == "written_between")
    names = _kernel_names(_lower(mod, CUDA, {"n": (1, 64)}))
    assert "layer_norm" in names and "matmul_nt_gemv" in names, names


def test_a_norm_then_the_matmul_as_one_function_equals_numpy():
    """``compose_after`` (what a GEMV kernel with the norm's prologue is a schedule of),
    the layer norm as TVM legalizes it then ``matmul_prim_func``, built for the CPU, against
    numpy in float64; ``row_norm`` takes the norm and refuses a matmul or a GELU."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.few_rows_gemv import compose_after, row_norm

    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from models import layer_norm_numpy  # pylint: disable=import-outside-toplevel

    legalized = relax.transform.LegalizeOps()(_norm_layer())
    norm = next(f for g, f in legalized.functions_items() if g.name_hint == "layer_norm")
    assert row_norm(norm)
    function = MATMUL_FUNCTIONS["grape.cublaslt.matmul_bias_nt"]
    plain = matmul_prim_func(function, list(norm.params[-1].shape[:-1]), 256, 40, "float32")
    assert not row_norm(plain)
    x = te.placeholder((8, 16), "float32", "x")
    k = te.reduce_axis((0, 16), "k")
    total = te.compute((), lambda: te.sum(x[0, k], axis=k), name="total")
    assert not row_norm(te.create_prim_func([x, total]))  # a 0-d output: no rows
    composed = compose_after(norm, plain).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": composed}), target="llvm")
    rng = np.random.default_rng(3)
    for rows in (1, 5, 33):
        x = rng.standard_normal((rows, 256)).astype(np.float32) + 3
        g, b = (rng.standard_normal(256).astype(np.float32) for _ in range(2))
        w, bias = rng.standard_normal((40, 256)).astype(np.float32), rng.standard_normal(40).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((rows, 40), np.float32))
        lib["main"](*(tvm.runtime.tensor(a) for a in (x, g, b, w, bias)), out)
        normed = layer_norm_numpy(x.astype(np.float64), g, b)
        np.testing.assert_allclose(out.numpy(), normed @ w.T.astype(np.float64) + bias,
                                   rtol=1e-4, atol=1e-4)


def test_a_norm_over_rows_that_are_an_expression_of_dims_is_left_alone():
    """x (n, s, K) reshaped to (n * s, K) before its layer norm: the norm's kernel takes n
    and s as scalars besides its tensors, and its rows are n * s, no one row count to
    dispatch on. The build succeeds with the norm a kernel of its own (a review found it
    raising AttributeError)."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.compiler import _lower  # pylint: disable=import-outside-toplevel

    n, s = tirx.Var("n", "int64"), tirx.Var("s", "int64")
    x = relax.Var("x", relax.TensorType((n, s, 256), "float32"))
    g, b = (relax.Var(name, relax.TensorType((256,), "float32")) for name in ("g", "b"))
    w = relax.Var("w", relax.TensorType((128, 256), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            rows = bb.emit(relax.op.reshape(x, (n * s, 256)))
            normed = bb.emit(relax.op.nn.layer_norm(rows, g, b, axes=[-1], epsilon=1e-5))
            y = bb.emit_output(relax.op.matmul(normed, relax.op.permute_dims(w)))
        bb.emit_func_output(y)
    names = _kernel_names(_lower(bb.get(), CUDA, {"n": (1, 8), "s": (1, 8)}))
    assert not [name for name in names if "layer_norm" in name and name.endswith("_gemv")], names


def test_a_norm_before_a_matmul_of_one_static_row_is_one_kernel():
    """x: (1, K), a decode step of batch 1 with static shapes: the norm and the matmul are
    one GEMV kernel, no dispatch, no library call, no kernel of the norm's own."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.compiler import _lower  # pylint: disable=import-outside-toplevel

    x = relax.Var("x", relax.TensorType((1, 256), "float32"))
    g, b = (relax.Var(name, relax.TensorType((256,), "float32")) for name in ("g", "b"))
    w = relax.Var("w", relax.TensorType((128, 256), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            y = bb.emit_output(relax.op.matmul(normed, relax.op.permute_dims(w)))
        bb.emit_func_output(y)
    lowered = _lower(bb.get(), CUDA, {})
    (fused,) = [name for name in _kernel_names(lowered) if name.endswith("_gemv")]
    assert "layer_norm" in fused and "layer_norm" not in _kernel_names(lowered)
    script = lowered[fused].script()
    assert _bounds(lowered[fused]) == [] and "call_packed" not in script
    assert script.count('thread="blockIdx.x"') == 1  # one kernel
