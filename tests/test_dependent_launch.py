"""``ProgrammaticDependentLaunch`` (passes/dependent_launch.py): every kernel of a CUDA sm_90
build lets its dependents launch and waits for the kernel before it first; a GEMV reads its
weights before that wait only where they are the model's weights (constants, or parameters
of ``main`` bound once) and nothing in the call writes them. Checked on tiny modules, on
TVM's lowering (the launch tag the CUDA runtime reads), on the CUDA source, and on the SASS
ptxas makes of it (read with nvdisasm: what the GPU runs). The kernels' results with the
prologue are checked on the CPU (tests/test_gemv_on_cpu.py runs them through the pipeline)
and on the GPU (tests/test_gpu.py: every CUDA artifact is built with it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm.ir as ir
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm_ffi.structural import structural_equal, structural_walk

import grape_tvm
from grape_tvm.compiler import _cuda_sources, _lower
from test_gemv import CUDA, _cuda, _kernel_body, _lowered
from test_gemv_on_cpu import DEFINITION
from grape_tvm.passes import ProgrammaticDependentLaunch
from grape_tvm.passes.kernel_attributes import (KERNEL_ATTRIBUTE_MARK, MIN_BLOCKS_PER_SM, NO_ALIAS,
                                               KernelAttributes, coherent_loads_mark,
                                               min_blocks_mark)
from grape_tvm.runtime.cuda_compile import nvcc_available
from grape_tvm.passes.dependent_launch import (KERNEL_LAUNCH_PARAMS, PDL_LAUNCH_TAG,
                                               WEIGHTS_HELD_MIN_BLOCKS,
                                               _RelaxUses, _weights_of, _with_loop_body,
                                               supports_dependent_launch)
from grape_tvm.passes.gemv_schedule import BUCKETS

LAUNCH = "tvm_builtin_ptx_griddepcontrol_launch_dependents();"
WAIT = "tvm_builtin_ptx_griddepcontrol_wait();"


def _two_kernels() -> tvm.IRModule:
    @T.prim_func
    def add_twice(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32"),
                  C: T.Buffer((1024,), "float32")):
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                B[bx * 128 + tx] = A[bx * 128 + tx] + T.float32(1)
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                C[bx * 128 + tx] = B[bx * 128 + tx] + T.float32(1)

    @T.prim_func
    def on_host(A: T.Buffer((4,), "float32")):
        for i in range(4):
            A[i] = T.float32(0)

    return tvm.IRModule({"add_twice": add_twice, "on_host": on_host})


def _kernel_bodies(func: tirx.PrimFunc) -> dict[str, str]:
    """Each kernel's body in ``func``'s CUDA source (after its signature), by name."""
    source = _cuda(func)
    return {m.group(1): _kernel_body(source, m.group(1)).split("{", 1)[1]
            for m in DEFINITION.finditer(source)}


def _statements(body: str) -> list[str]:
    """The kernel's statements, declarations of its local arrays left out."""
    return [s.strip() for s in body.splitlines()
            if s.strip() and not re.match(r"(__shared__ )?alignas", s.strip())]


def _host_launches(func: tirx.PrimFunc) -> list:
    """The host side's kernel launches of ``func`` lowered by TVM for CUDA."""
    host = next(f for g, f in _lowered(func).functions_items() if g.name_hint == "main")
    found = []

    def on_call(call):
        if isinstance(call.op, ir.Op) and call.op.name == "tirx.call_ffi_kernel":
            found.append(call)

    structural_walk(host.body, ((ir.Call, on_call),))
    return found


def test_every_kernel_lets_its_dependents_launch_then_waits_first():
    mod = ProgrammaticDependentLaunch(CUDA)(_two_kernels())
    func = mod["add_twice"]
    assert list(func.attrs[KERNEL_LAUNCH_PARAMS]) == [PDL_LAUNCH_TAG]
    bodies = _kernel_bodies(func)
    assert len(bodies) == 2
    for body in bodies.values():
        assert _statements(body)[:2] == [LAUNCH, WAIT]
    # the host launches both with the tag, which takes no launch argument (TVM's CUDA runtime
    # reads it as a flag: programmatic stream serialization)
    launches = _host_launches(func)
    assert len(launches) == 2
    for call in launches:
        params = list(call.attrs.launch_params)
        assert params == ["blockIdx.x", "threadIdx.x", PDL_LAUNCH_TAG]
        kernel_args = len(call.args) - 1 - 2  # the symbol, then (A, B) or (B, C), then 2 extents
        assert kernel_args == 2
    assert structural_equal(mod["on_host"], _two_kernels()["on_host"])  # no kernel: as it was


@pytest.mark.parametrize("target", [
    tvm.target.Target({"kind": "cuda", "arch": "sm_80"}), tvm.target.Target("llvm")])
def test_below_sm_90_and_on_the_cpu_nothing_changes(target):
    assert not supports_dependent_launch(target)
    before = _two_kernels()
    assert structural_equal(ProgrammaticDependentLaunch(target)(before), before)


@pytest.mark.parametrize("arch, supported", [("sm_90", True), ("sm_90a", True),
                                             ("sm_100", True), ("sm_89", False)])
def test_the_architectures_with_griddepcontrol(arch, supported):
    assert supports_dependent_launch(tvm.target.Target({"kind": "cuda", "arch": arch})) == supported


def _linear(weight: str, k: int = 768, n: int = 256, normed: bool = False) -> tvm.IRModule:
    """``gelu(x @ w.T + b)`` with x: (m, k) and w: (n, k), whose ``w`` is ``weight``:
    "param" (``main``'s), "constant", or "computed" (``w * 2`` inside the call); ``normed``:
    of ``layer_norm(x)`` (its scale and shift ``main``'s last parameters), which the
    one-row GEMV kernel computes itself."""
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    params = [x, b]
    rng = np.random.default_rng(0)
    if weight == "constant":
        w = relax.const(rng.standard_normal((n, k)).astype("float32"))
    else:
        w = relax.Var("w", relax.TensorType((n, k), "float32"))
        params.append(w)
    scale, shift = (relax.Var(name, relax.TensorType((k,), "float32")) for name in ("g", "s"))
    if normed:
        params += [scale, shift]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            if weight == "computed":
                w = bb.emit(relax.op.multiply(w, relax.const(2.0, "float32")))
            if normed:
                x = bb.emit(relax.op.nn.layer_norm(x, scale, shift, axes=[-1], epsilon=1e-5))
            y = relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), b)
            out = bb.emit_output(relax.op.nn.gelu(y))
        bb.emit_func_output(out)
    return bb.get()


def _gemv_source(weight: str, bound: tuple[int, ...] = ()) -> dict[str, str]:
    """The one-row GEMV kernel of ``_linear(weight)`` lowered by grape's pipeline (main's
    parameters at ``bound`` bound once), by kernel name."""
    lowered = _lower(_linear(weight), CUDA, {"m": (1, 64)}, weights=bound)
    (func,) = [f for g, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and "matmul" in g.name_hint]
    return _kernel_bodies(func)


def _waits_after_the_weights(body: str) -> bool:
    statements = _statements(body)
    assert statements[0] == LAUNCH
    wait = statements.index(WAIT)
    weight_loads = [i for i, s in enumerate(statements) if s.startswith("*(float4*)(w_local")]
    reads_x = [i for i, s in enumerate(statements) if "x_ptr" in s]
    assert weight_loads and reads_x
    assert min(reads_x) > wait  # activations only after the wait, in either case
    return max(weight_loads) < wait


@pytest.mark.parametrize("weight, bound", [("constant", ()), ("param", (2,))])
def test_a_gemv_loads_the_models_weights_before_it_waits(weight, bound):
    """Every GEMV kernel (one per bucket of rows) loads its thread's weights into registers,
    then waits, then reads x: the loads are in flight while the kernel before it ends."""
    bodies = _gemv_source(weight, bound)
    gemv = {n: b for n, b in bodies.items() if "w_local" in b}
    assert len(gemv) >= 2
    assert all(_waits_after_the_weights(b) for b in gemv.values())


@pytest.mark.parametrize("weight, bound", [
    ("param", ()),        # a parameter passed with every call: the caller may just have written it
    ("computed", (2,)),   # computed in the call, by the kernel right before
])
def test_a_gemv_waits_before_weights_that_are_not_the_models(weight, bound):
    bodies = _gemv_source(weight, bound)
    gemv = {n: b for n, b in bodies.items() if "w_local" in b}
    assert gemv
    assert not any(_waits_after_the_weights(b) for b in gemv.values())


@pytest.mark.parametrize("bound", [["w"], []])
def test_each_gemv_holding_its_weights_asks_for_coherent_loads_and_blocks_an_sm(bound):
    """Through ``build`` (grape's TIR pipeline, not TVM's): each kernel that loads its
    weights before the wait has no ``__restrict__`` parameter and asks for a minimum of
    blocks an SM; every other kernel keeps TVM's ``__restrict__``."""
    module = grape_tvm.build(_linear("param"), {"m": (1, 64)}, CUDA, output_names=["y"],
                             weights=bound, prebuild_cubin=False)
    source = "".join(_cuda_sources(module.executable))
    assert KERNEL_ATTRIBUTE_MARK not in source
    signatures = {m.group(1): m.group(0) for m in DEFINITION.finditer(source)}
    holds = {name: "w_local" in body and _waits_after_the_weights(body)
             for name, body in ((n, _kernel_body(source, n).split("{", 1)[1]) for n in signatures)}
    assert sum(holds.values()) == (len(BUCKETS) if bound else 0)
    for name, held in holds.items():
        assert (f", {WEIGHTS_HELD_MIN_BLOCKS}) " in signatures[name]) == held, name
        assert ("__restrict__" in signatures[name]) != held, name


def _nvdisasm() -> str | None:
    """NVIDIA's disassembler: on PATH, or from the nvidia-cuda-nvdisasm wheel (test extra)."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    wheel = sorted(p for root in map(Path, nvidia.__path__) for p in root.glob("*/bin/nvdisasm"))
    return str(wheel[-1]) if wheel else None


def _sass(cubin: bytes, tmp_path: Path) -> dict[str, list[str]]:
    """Each kernel's SASS instructions in a cubin (predicate left out), by kernel name."""
    path = tmp_path / "kernels.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([_nvdisasm(), "-c", str(path)], check=True, capture_output=True,
                          text=True).stdout
    kernels: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        section = re.match(r"\.text\.(\w+):", line)
        if section:
            current = kernels.setdefault(section.group(1), [])
        instruction = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([^;]+);", line)
        if instruction and current is not None:
            current.append(instruction.group(1).strip())
    return kernels


def _kernel_chain() -> tvm.IRModule:
    """``gelu(exp(x) @ w + b)`` with x: (m, 256), w: (256, 512) stored [K, N]: the matmul
    reads the output of the kernel before it (above 8 rows in dlight's Matmul kernel,
    ``matmul="grape"``); w not bound, its GEMV kernel of 5 to 8 rows loaded it, through
    ``__restrict__``, above a wait with no fence after it."""
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((m, 256), "float32"))
    w = relax.Var("w", relax.TensorType((256, 512), "float32"))
    b = relax.Var("b", relax.TensorType((512,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            produced = bb.emit(relax.op.exp(x))
            y = relax.op.add(relax.op.matmul(produced, w), b)
            out = bb.emit_output(relax.op.nn.gelu(y))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.skipif(not nvcc_available(), reason="needs nvcc")
@pytest.mark.parametrize("model, bound, matmul", [
    ("linear", ["w"], "grape"), ("linear", [], "grape"), ("normed", ["w"], None),
    ("chain", ["w"], "grape"), ("chain", [], "grape")])
def test_in_sass_no_kernel_loads_before_its_wait_but_the_weights_it_holds(model, bound, matmul,
                                                                          tmp_path):
    """What the SASS does, which is what runs: ptxas (sm_90, nvcc 13.0) schedules the wait
    (``ACQBULK``) freely around non-coherent loads (``LDG.E.*.CONSTANT``, which nvcc makes of
    loads through ``__restrict__`` pointers the kernel never writes). With TVM's
    ``__restrict__`` parameters it put the wait above the weights' loads in every GEMV
    kernel holding them, and, with the wait alone, a load of the kernel before's output
    above it in a GEMV kernel of a few rows (``chain``, w not bound). A kernel holding its
    weights loads coherently only and issues exactly its weight loads before the wait (a
    count: coherent loads stay on their side of it); every other kernel, behind its wait
    and fence, none. ``normed``: the one-row kernel computes a layer norm's statistics of
    x first, after its wait (built with the default ``matmul``: ``matmul="grape"`` leaves
    the norm a kernel of its own); ``chain``: a kernel before the matmul, whose rows above
    8 run dlight's kernel."""
    assert _nvdisasm(), "nvdisasm not found: install the test extra (nvidia-cuda-nvdisasm)"
    mod = _kernel_chain() if model == "chain" else _linear("param", normed=model == "normed")
    module = grape_tvm.build(mod, {"m": (1, 64)}, CUDA, output_names=["y"], weights=bound,
                             matmul=matmul)
    source = "".join(_cuda_sources(module.executable))
    sass = {}
    for cubin in module.cubins.values():
        sass.update(_sass(cubin, tmp_path))
    held = normed = 0
    for match in DEFINITION.finditer(source):
        name = match.group(1)
        statements = _statements(_kernel_body(source, name).split("{", 1)[1])
        # the weights' loads of grape's GEMV kernels (TVM names their registers w_local)
        weight_loads = sum(re.match(r"\*\(float4\*\)\(w\w*_local", s) is not None
                           for s in statements[:statements.index(WAIT)])
        instructions = sass[name]
        wait = instructions.index("ACQBULK")
        before = [i for i in instructions[:wait] if i.startswith("LDG")]
        assert len(before) == weight_loads, (name, instructions[:wait + 1])
        if weight_loads:
            held += 1
            normed += any("x_ptr[" in st for st in statements)  # x's statistics, not normed
            loads = [i for i in instructions if i.startswith("LDG")]
            assert not any(".CONSTANT" in i for i in loads), (name, loads)
    assert held == (len(BUCKETS) if bound else 0)
    assert normed == (model == "normed")


@pytest.mark.parametrize("normed", [False, True])
def test_a_gemv_of_one_static_row_loads_its_weights_first(normed):
    """x: (1, K), static (a decode step of batch 1): the kernel's partial sums have no row
    iter, and the weights' register cache is made from the other five (the six-iter map
    alone failed in ReindexCacheRead, the build with it)."""
    x = relax.Var("x", relax.TensorType((1, 256), "float32"))
    w = relax.Var("w", relax.TensorType((128, 256), "float32"))
    scale, shift = (relax.Var(name, relax.TensorType((256,), "float32")) for name in ("g", "s"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, scale, shift]):
        with bb.dataflow():
            if normed:
                x = bb.emit(relax.op.nn.layer_norm(x, scale, shift, axes=[-1], epsilon=1e-5))
            y = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w)))
        bb.emit_func_output(y)
    lowered = _lower(bb.get(), CUDA, {}, weights=(1,))
    (func,) = [f for g, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and g.name_hint.endswith("_gemv")]
    (body,) = _kernel_bodies(func).values()
    assert _waits_after_the_weights(body)


def test_kernel_attributes_takes_the_marks_into_the_kernels_attributes():
    @T.prim_func
    def kernel(A: T.Buffer((256,), "float32")):
        T.func_attr({"global_symbol": "kernel", "tirx.noalias": True})
        for tx in T.thread_binding(256, thread="threadIdx.x"):
            A[tx] = T.float32(1)

    loop = kernel.body
    marked = kernel.with_body(_with_loop_body(
        loop, min_blocks_mark(3, coherent_loads_mark(loop.body))))
    assert KERNEL_ATTRIBUTE_MARK in marked.script()
    done = KernelAttributes()(tvm.IRModule({"kernel": marked}))["kernel"]
    assert int(done.attrs[MIN_BLOCKS_PER_SM]) == 3
    assert not bool(done.attrs[NO_ALIAS])
    assert KERNEL_ATTRIBUTE_MARK not in done.script()
    assert structural_equal(done.body, kernel.body)
    unmarked = KernelAttributes()(tvm.IRModule({"kernel": kernel}))["kernel"]
    assert MIN_BLOCKS_PER_SM not in unmarked.attrs and bool(unmarked.attrs[NO_ALIAS])
    twice = kernel.with_body(_with_loop_body(
        loop, min_blocks_mark(3, min_blocks_mark(2, loop.body))))
    with pytest.raises(Exception, match="marked both"):
        KernelAttributes()(tvm.IRModule({"kernel": twice}))


def test_without_dependent_launch_no_kernel_waits():
    lowered = _lower(_linear("constant"), CUDA, {"m": (1, 64)}, dependent_launch=False)
    for gvar, func in lowered.functions_items():
        if isinstance(func, tirx.PrimFunc):
            assert PDL_LAUNCH_TAG not in list((func.attrs or {}).get(KERNEL_LAUNCH_PARAMS, []))
            assert "griddepcontrol" not in func.script(), gvar.name_hint


def _called_kernels(lowered: tvm.IRModule) -> list[str]:
    """The PrimFuncs with a thread binding that the lowered module's Relax functions call."""
    kernels = {g.name_hint for g, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and "thread_binding" in f.script()}
    called = []

    def on_gvar(gvar):
        if gvar.name_hint in kernels:
            called.append(gvar.name_hint)

    for func in lowered.functions.values():
        if isinstance(func, relax.Function):
            structural_walk(func.body, ((ir.GlobalVar, on_gvar),))
    return sorted(called)


def test_a_reshape_stays_a_view():
    """Regression: the pass ran before RewriteDataflowReshape, which recognises a reshape by
    its PrimFunc's body; with the prologue in it, every reshape of GPT-2's decode step was a
    copy kernel (210 kernels a step instead of 90, measured on the H200)."""
    m = tirx.Var("m", "int64")
    x = relax.Var("x", relax.TensorType((m, 768), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(x, relax.const(1.0, "float32")))
            heads = bb.emit(relax.op.reshape(y, (m, 12, 64)))
            out = bb.emit_output(relax.op.multiply(heads, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    mod = bb.get()
    kernels = {flag: _called_kernels(_lower(mod, CUDA, {"m": (1, 64)}, dependent_launch=flag))
               for flag in (True, False)}
    assert kernels[True] == kernels[False]
    assert not any("reshape" in name for name in kernels[True])


def test_a_weight_viewed_in_the_call_is_read_after_the_wait():
    """``w`` also reshaped (a view of it leaves the call): not read before the wait."""
    mod = _linear("param")
    func = mod["main"]
    x, b, w = func.params
    bb = relax.BlockBuilder()
    with bb.function("main", [x, b, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.gelu(relax.op.add(
                relax.op.matmul(x, relax.op.permute_dims(w)), b)))
            flat = bb.emit(relax.op.reshape(w, (256 * 768,)))
            out = bb.emit_output(relax.Tuple([y, flat]))
        bb.emit_func_output(out)
    lowered = _lower(bb.get(), CUDA, {"m": (1, 64)}, weights=(2,))
    (gemv,) = [f for g, f in lowered.functions_items()
               if isinstance(f, tirx.PrimFunc) and "matmul" in g.name_hint]
    bodies = [b for b in _kernel_bodies(gemv).values() if "w_local" in b]
    assert bodies and not any(_waits_after_the_weights(b) for b in bodies)


def test_a_weight_written_in_place_is_not_a_weight():
    @T.prim_func
    def scale(w: T.Buffer((4,), "float32")):
        for i in range(4):
            w[i] = w[i] * T.float32(2)

    @T.prim_func
    def read(w: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
        for i in range(4):
            y[i] = w[i]

    bb = relax.BlockBuilder()
    scale_gv, read_gv = bb.add_func(scale, "scale"), bb.add_func(read, "read")
    w = relax.Var("w", relax.TensorType((4,), "float32"))
    v = relax.Var("v", relax.TensorType((4,), "float32"))
    with bb.function("main", [w, v]):
        with bb.dataflow():
            bb.emit(relax.call_tir_inplace(scale_gv, (w,), [0],
                                           relax.TensorType((4,), "float32")))
            out = bb.emit_output(relax.call_tir(read_gv, (v,),
                                                relax.TensorType((4,), "float32")))
        bb.emit_func_output(out)
    mod = bb.get()
    assert {p.name for p in _weights_of(mod, frozenset({0, 1}), _RelaxUses.of(mod))} == {"v"}


def test_a_primfunc_with_a_launch_thread_kernel_is_left_as_it_was():
    """Its ``thread_extent`` kernel would get the tag and no wait: the whole PrimFunc keeps
    its plain launches (regression: the tag launched that kernel early)."""
    @T.prim_func
    def mixed(A: T.Buffer((1024,), "float32"), B: T.Buffer((1024,), "float32"),
              C: T.Buffer((1024,), "float32")):
        for bx in T.thread_binding(8, thread="blockIdx.x"):
            for tx in T.thread_binding(128, thread="threadIdx.x"):
                B[bx * 128 + tx] = A[bx * 128 + tx] + T.float32(1)
        bx = T.launch_thread("blockIdx.x", 8)
        tx = T.launch_thread("threadIdx.x", 128)
        C[bx * 128 + tx] = B[bx * 128 + tx] + T.float32(1)

    before = tvm.IRModule({"mixed": mixed})
    assert structural_equal(ProgrammaticDependentLaunch(CUDA)(before), before)
