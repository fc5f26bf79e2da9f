"""grape's GPU rule for element-wise kernels over a symbolic number of rows of static width
(``passes/injective_schedule.py``), on tiny modules: the schedule it makes, and what it
leaves to dlight's ``Fallback``. The kernels run on the GPU (tests/test_gpu.py: every GPU
test whose model concatenates a cache, and GPT-2 in bench/hf_models.py)."""

from __future__ import annotations

from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm_ffi.structural import structural_walk

from grape_tvm.passes.injective_schedule import RowsOfStaticWidth
from test_passes import CUDA, fused_kernel


def _kernel(make, *types) -> tirx.PrimFunc:
    """The one PrimFunc of ``make(*params)``, legalized and fused as grape does."""
    params = [relax.Var(f"x{i}", ty) for i, ty in enumerate(types)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(*params))
        bb.emit_func_output(out)
    return fused_kernel(bb.get())


def _symbolic_divisions(func: tirx.PrimFunc) -> list:
    """Divisions and modulos of the kernel's indices by a value known only at run time."""
    found = []

    def visit(node):
        if not isinstance(node.b, tirx.IntImm):
            found.append(node)

    structural_walk(func.body, tuple((kind, visit) for kind in
                                     (tirx.FloorDiv, tirx.FloorMod, tirx.Div, tirx.Mod)))
    return found


def _cache_concat() -> tirx.PrimFunc:
    b, p = tirx.Var("b", "int64"), tirx.Var("p", "int64")
    return _kernel(lambda past, new: relax.op.concat([past, new], axis=2),
                   relax.TensorType((b, 12, p, 64), "float32"),
                   relax.TensorType((b, 12, 1, 64), "float32"))


def test_a_cache_concat_binds_rows_and_width_without_symbolic_division():
    func = _cache_concat()
    sch = RowsOfStaticWidth().apply(func, CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    text = scheduled.script()
    for axis in ("blockIdx.x", "blockIdx.y", "threadIdx.x", "threadIdx.y"):
        assert axis in text, axis
    assert _symbolic_divisions(scheduled) == []
    fallback = dl.gpu.Fallback().apply(_cache_concat(), CUDA, False).mod["main"]
    assert _symbolic_divisions(fallback)  # what the rule is for: Fallback divides by p


def test_static_rows_and_narrow_rows_are_left_to_the_fallback():
    n = tirx.Var("n", "int64")
    static = _kernel(lambda x: relax.op.add(x, x), relax.TensorType((8, 64), "float32"))
    narrow = _kernel(lambda x: relax.op.add(x, x), relax.TensorType((n, 16), "float32"))
    assert RowsOfStaticWidth().apply(static, CUDA, False) is None
    assert RowsOfStaticWidth().apply(narrow, CUDA, False) is None


def test_rows_wider_than_a_block_loop_over_their_part_in_each_thread():
    n = tirx.Var("n", "int64")
    for width, threads in ((1536, 768), (6144, 1024)):
        sch = RowsOfStaticWidth().apply(
            _kernel(lambda x: relax.op.add(x, x), relax.TensorType((n, width), "float32")),
            CUDA, False)
        assert sch is not None, width
        scheduled = sch.mod["main"]
        bound = {}

        def visit(loop):
            if loop.thread_binding is not None:
                bound[loop.thread_binding.thread_tag] = int(loop.extent) \
                    if isinstance(loop.extent, tirx.IntImm) else loop.extent
        structural_walk(scheduled.body, ((tirx.For, visit),))
        assert bound["threadIdx.x"] == threads, (width, bound)
        assert _symbolic_divisions(scheduled) == []
    odd = _kernel(lambda x: relax.op.add(x, x), relax.TensorType((n, 50257), "float32"))
    assert RowsOfStaticWidth().apply(odd, CUDA, False) is None  # no multiple of 32 divides it
