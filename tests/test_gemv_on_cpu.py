"""The CUDA that grape's GEMV rule generates, run on the CPU and checked against numpy.

Each kernel of a scheduled matmul (the GEMV kernels of the buckets and dlight's Matmul above
them) is the CUDA source TVM hands nvcc, compiled with g++ against ``cuda_on_cpu.h``: a CUDA
thread per OS thread, ``__syncthreads`` and the warp shuffles as barriers and exchanges. The
host side's choice of kernel and its launch dimensions are read from TVM's lowering of the
same PrimFunc at the given M. Blocks run one at a time, in one order and in the reverse order:
a block writing outside its tile would show as a difference. What the GPU adds (timing,
memory ordering between blocks, the driver) is tests/test_gpu.py's.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm.ir as ir
from tvm import tirx
from tvm_ffi.structural import structural_walk

from grape_tvm.passes import DecodeGemv
from grape_tvm.passes.dependent_launch import PDL_LAUNCH_TAG, WEIGHTS_FIRST
from grape_tvm.passes.gemv_schedule import gemv_config, match_gemv
from test_gemv import CUDA, _lowered, _matmul, _the_kernel

HEADER = Path(__file__).with_name("cuda_on_cpu.h")
DEFINITION = re.compile(r'extern "C" __global__ void __launch_bounds__\([\d, ]+\) (\w+)\(([^)]*)\) \{')


def _gxx_cxx20_float16() -> bool:
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"],
                           input="#include <barrier>\n_Float16 h = 1;\n", text=True,
                           capture_output=True, check=False)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _gxx_cxx20_float16(),
                                reason="needs g++ with C++20 <barrier> and _Float16")


class CpuKernels:
    """The kernels of ``func`` compiled for the CPU; ``launch(m, buffers)`` runs the one the
    host code launches at M = m, with its launch dimensions and scalar arguments."""

    def __init__(self, func: tirx.PrimFunc, workdir: Path):
        self.func = func
        source = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                                CUDA).imports[0].inspect_source()
        body = source[source.index('extern "C" __global__'):]
        body = re.sub(r'extern "C" __global__ void __launch_bounds__\([\d, ]+\) \w+\([^)]*\);\n', "",
                      body)
        body = re.sub(r"__shared__ alignas\((\d+)\) ", r"alignas(\1) static ", body)
        self.params = {name: [p.strip() for p in params.split(",")]
                       for name, params in DEFINITION.findall(body)}
        wrappers = []
        for name, params in self.params.items():
            args = [f"({p.split('*')[0].strip()}*)a[{i}]" if "*" in p else f"*(int64_t*)a[{i}]"
                    for i, p in enumerate(params)]
            wrappers.append(f'extern "C" void run_{name}(void** a, unsigned gx, unsigned gy, '
                            f'unsigned bx, unsigned by) {{\n  launch([=]() {{ {name}('
                            f'{", ".join(args)}); }}, gx, gy, bx, by);\n}}\n')
        code = f'#include "{HEADER}"\n{body}\n' + "\n".join(wrappers)
        lib = workdir / f"k_{hashlib.sha256(code.encode()).hexdigest()[:16]}.so"
        if not lib.exists():
            src = lib.with_suffix(".cpp")
            src.write_text(code)
            subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
                            "-o", str(lib), str(src)], check=True, capture_output=True)
        self.lib = ctypes.CDLL(str(lib))
        self.host = _lowered(func)["main"]

    def _launch_at(self, m: int):
        """(kernel, scalar-or-pointer arguments, launch extents) the host launches at m."""
        ana = tvm.sym.Analyzer()
        rows = []
        structural_walk(self.host.body, ((tirx.Var, lambda v: rows.append(v) if v.name == "m" else None),))
        for var in {id(v): v for v in rows}.values():
            ana.bind(var, tirx.IntImm("int64", m))
        found = []

        def walk(stmt):
            if isinstance(stmt, tirx.IfThenElse):
                cond = stmt.condition
                if isinstance(cond, ir.Call) and cond.op.name == "tirx.tvm_thread_invariant":
                    taken = bool(int(ana.simplify(cond.args[0])))  # the dispatch on M
                    branches = [stmt.then_case if taken else stmt.else_case]
                else:  # the packed function's argument checks
                    branches = [stmt.then_case, stmt.else_case]
                for branch in branches:
                    if branch is not None:
                        walk(branch)
            elif isinstance(stmt, tirx.SeqStmt):
                for s in stmt.seq:
                    walk(s)
            elif isinstance(stmt, tirx.Bind):
                try:  # the host's lets of sizes (not its reads of the packed arguments)
                    ana.bind(stmt.var, ana.simplify(stmt.value))
                except (TypeError, tvm.error.InternalError):
                    pass
            elif isinstance(stmt, tirx.Evaluate):
                call = stmt.value
                if isinstance(call, ir.Call) and call.op.name == "tirx.call_ffi_kernel":
                    found.append(call)
            elif hasattr(stmt, "body"):
                walk(stmt.body)

        walk(self.host.body)
        (call,) = found
        # a flag (programmatic dependent launch) takes no argument
        launch_params = [p for p in call.attrs.launch_params if p != PDL_LAUNCH_TAG]
        count = len(call.args) - 1 - len(launch_params)
        args = [call.args[1 + i] for i in range(count)]  # pointers stay expressions
        args = [ana.simplify(a) if str(a.ty).startswith("int") else a for a in args]
        extents = {p: int(ana.simplify(call.args[1 + count + i]))
                   for i, p in enumerate(launch_params)}
        return str(call.args[0].value), args, extents

    def launch_extents(self, m: int) -> dict[str, int]:
        """The launch extents (blockIdx.x, threadIdx.y, ...) of the kernel run at M = m."""
        return self._launch_at(m)[2]

    def launch(self, m: int, buffers: dict[str, np.ndarray], output: np.ndarray,
               reverse: bool = False) -> str:
        name, args, extents = self._launch_at(m)
        keep, pointers = [], []
        for param, arg in zip(self.params[name], args):
            if "*" in param:  # NAME_ptr: buffer NAME, the output where not an input
                value = buffers.get(param.split()[-1][:-len("_ptr")], output)
                pointers.append(value.ctypes.data)
            else:
                value = ctypes.c_int64(int(arg))
                pointers.append(ctypes.addressof(value))
            keep.append(value)
        ctypes.c_int.in_dll(self.lib, "reverse_blocks").value = int(reverse)
        array = (ctypes.c_void_p * len(pointers))(*pointers)
        extent = lambda key: extents.get(key, 1)  # noqa: E731
        getattr(self.lib, f"run_{name}")(array, extent("blockIdx.x"), extent("blockIdx.y"),
                                         extent("threadIdx.x"), extent("threadIdx.y"))
        return name


class _Never:
    """A large-M rule that declines: the largest bucket's GEMV kernel takes every M above."""

    def apply(self, *_):
        return None


def _expected_kernel(m: int, gemv_above: bool) -> str:
    """The host's choice: bucket i (M <= 1, 2, 4, 8) launches main_kernel[_i], dlight's
    Matmul is main_kernel_4; without it the largest bucket's kernel takes M > 8."""
    index = next((i for i, bound in enumerate((1, 2, 4, 8)) if m <= bound), 3 if gemv_above else 4)
    return "main_kernel" if index == 0 else f"main_kernel_{index}"


def _gelu(h):
    from math import erf, sqrt  # pylint: disable=import-outside-toplevel

    return 0.5 * h * (1 + np.vectorize(erf)(h / sqrt(2)))


CASES = [  # (layout, dtype, K, N): vector and scalar loads, with and without padded tiles
    ("kn", "float32", 256, 516), ("kn", "float16", 256, 102),
    ("nk", "float32", 192, 102), ("nk", "float16", 256, 520),
]


@pytest.mark.parametrize("gemv_above", [False, True], ids=["dlight above 8", "gemv for all M"])
@pytest.mark.parametrize("layout,dtype,k,n", CASES, ids=lambda v: str(v))
def test_generated_cuda_equals_numpy(layout, dtype, k, n, gemv_above, tmp_path_factory):
    func = _the_kernel(_matmul(k=k, n=n, layout=layout, dtype=dtype))
    rule = DecodeGemv(large=_Never() if gemv_above else None)
    kernels = CpuKernels(rule.apply(func, CUDA, False).mod["main"],
                         tmp_path_factory.getbasetemp())
    rows = (3, 9, 20) if gemv_above else (1, 2, 3, 8, 9, 40)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for m in rows:
        rng = np.random.default_rng(m)
        x = rng.standard_normal((m, k)).astype(dtype)
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
        b = (0.1 * rng.standard_normal(n)).astype(dtype)
        inputs = {"x": x, "w": w if layout == "kn" else np.ascontiguousarray(w.T), "b": b}
        want = _gelu(x.astype(np.float64) @ w.astype(np.float64) + b)
        outs = []
        for reverse in (False, True):
            out = np.full((m, n), np.nan, dtype)
            name = kernels.launch(m, inputs, out, reverse)
            outs.append(out)
        assert name == _expected_kernel(m, gemv_above), (m, name)
        assert np.array_equal(outs[0], outs[1], equal_nan=True), f"block order matters at m={m}"
        got = outs[0].astype(np.float64)
        assert not np.isnan(got).any(), f"outputs left unwritten at m={m}"
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(),
                                   err_msg=f"{name} at m={m}")


def test_the_eight_row_kernel_spread_over_blocks_equals_numpy(tmp_path_factory):
    """A short grid (K = 1024, N = 256, weights [N, K]: the decode-loop decoder's MLP down
    projection) spreads the 8-row bucket over blocks of 2 rows (``rows_per_block``): M = 5
    to 8 launch ceil(M / 2) blocks along y, the last one padded at odd M."""
    k, n = 1024, 256
    func = _the_kernel(_matmul(k=k, n=n, layout="nk", epilogue="bias"))
    assert gemv_config(match_gemv(func), 8).rows == 2
    kernels = CpuKernels(DecodeGemv().apply(func, CUDA, False).mod["main"],
                         tmp_path_factory.getbasetemp())
    for m in (5, 6, 7, 8):
        rng = np.random.default_rng(m)
        x = rng.standard_normal((m, k)).astype("float32")
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype("float32")
        b = (0.1 * rng.standard_normal(n)).astype("float32")
        assert kernels.launch_extents(m)["blockIdx.y"] == -(-m // 2)
        outs = []
        for reverse in (False, True):
            out = np.full((m, n), np.nan, "float32")
            assert kernels.launch(m, {"x": x, "w": w, "b": b}, out, reverse) == "main_kernel_3"
            outs.append(out)
        assert np.array_equal(outs[0], outs[1]), f"block order matters at m={m}"
        want = x.astype(np.float64) @ w.T.astype(np.float64) + b
        np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=f"m={m}")


@pytest.mark.parametrize("rows", [1, 3])
def test_static_rows_one_kernel_equals_numpy(rows, tmp_path_factory):
    """M static (x: (1, K), a decode step of batch 1; or 3 rows, padded to the bucket of 4)."""
    k, n = 256, 516
    func = _the_kernel(_matmul(k=k, n=n, rows=(rows,)))
    kernels = CpuKernels(DecodeGemv().apply(func, CUDA, False).mod["main"],
                         tmp_path_factory.getbasetemp())
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k)).astype("float32")
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float32")
    b = (0.1 * rng.standard_normal(n)).astype("float32")
    out = np.full((rows, n), np.nan, "float32")
    assert kernels.launch(rows, {"x": x, "w": w, "b": b}, out) == "main_kernel"
    want = _gelu(x.astype(np.float64) @ w.astype(np.float64) + b)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _normed_matmul(kind: str, k: int, n: int, dtype: str, layout: str, bound: bool = False):
    """``y = norm(x) @ w`` with x: (m, k) (w stored [N, K] for "nk", as given for "kn"):
    ``kind`` "layer" (``nn.layer_norm``) or "rms" (x * rsqrt(mean(x * x, keepdims) + eps)
    * g, as a decoder writes it out), lowered by grape's pipeline for CUDA; ``bound``: w a
    weight bound once (an "nk" kernel then loads it first, before its wait)."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.compiler import _lower  # pylint: disable=import-outside-toplevel

    op = relax.op
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    g, b = (relax.Var(name, relax.TensorType((k,), dtype)) for name in ("g", "b"))
    w = relax.Var("w", relax.TensorType((n, k) if layout == "nk" else (k, n), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g, b, w]):
        with bb.dataflow():
            if kind == "layer":
                normed = bb.emit(op.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5))
            else:
                mean = op.mean(op.multiply(x, x), axis=[-1], keepdims=True)
                eps = relax.const(1e-5, dtype)
                normed = bb.emit(op.multiply(op.divide(x, op.sqrt(op.add(mean, eps))), g))
            weight = op.permute_dims(w) if layout == "nk" else w
            y = bb.emit_output(op.matmul(normed, weight))
        bb.emit_func_output(y)
    lowered = _lower(bb.get(), CUDA, {"m": (1, 64)}, weights=(3,) if bound else ())
    (name,) = [g.name_hint for g, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and g.name_hint.endswith("_gemv")]
    return name, lowered[name]


@pytest.mark.parametrize("kind,k,n,dtype,layout,bound", [
    ("layer", 256, 128, "float32", "nk", False), ("layer", 96, 128, "float32", "nk", False),
    ("layer", 768, 768, "float32", "kn", False), ("layer", 256, 128, "float16", "nk", False),
    ("rms", 256, 128, "float32", "nk", False), ("layer", 768, 256, "float32", "nk", True),
    ("layer", 256, 128, "float16", "nk", True), ("rms", 256, 128, "float32", "nk", True)])
def test_a_norm_computed_by_the_one_row_gemv_kernel_equals_numpy(kind, k, n, dtype, layout,
                                                                  bound, tmp_path_factory):
    """The one-row GEMV kernel with a row norm's prologue (``passes/few_rows_gemv.py``): its
    statistics summed across the block (96 wide: fewer elements than threads; 768 with
    512 threads: a remainder), x normalized as it is read; a layer norm and an RMS norm
    whose statistic keeps its unit dim, fp32 and fp16, against numpy in float64. With w
    bound (``bound``) the kernel loads its weights first, before the statistics."""
    name, func = _normed_matmul(kind, k, n, dtype, layout, bound)
    if bound:
        assert WEIGHTS_FIRST in func.script()
    assert ("layer_norm" if kind == "layer" else "mean") in name, name
    kernels = CpuKernels(func, tmp_path_factory.getbasetemp())
    rng = np.random.default_rng(k)
    x = (2 * rng.standard_normal((1, k)) + 1).astype(dtype)
    g = (1 + 0.3 * rng.standard_normal(k)).astype(dtype)
    b = (0.3 * rng.standard_normal(k)).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    x64 = x.astype(np.float64)
    if kind == "layer":
        sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
        from models import layer_norm_numpy  # pylint: disable=import-outside-toplevel

        normed = layer_norm_numpy(x64, g, b)
    else:
        normed = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * g
    want = normed @ w.astype(np.float64)
    # the RMS norm's kernel takes x * x too (TVM's FuseOps leaves the square to a kernel
    # before the mean)
    inputs = {"x": x, "g": g, "b": b, "lv": x * x,
              "w": w if layout == "kn" else np.ascontiguousarray(w.T)}
    outs = []
    for reverse in (False, True):
        out = np.full((1, n), np.nan, dtype)
        launched = kernels.launch(1, inputs, out, reverse)
        outs.append(out.astype(np.float64))
    assert np.array_equal(outs[0], outs[1], equal_nan=True)
    tol = 1e-4 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(outs[0], want, rtol=tol, atol=tol * np.abs(want).max(),
                               err_msg=launched)
