"""grape's GPU rule for element-wise kernels over a symbolic number of rows of static width
(``passes/injective_schedule.py``), on tiny modules: the schedule it makes, and what it
leaves to dlight's ``Fallback``. The kernels run on the GPU (tests/test_gpu.py: every GPU
test whose model concatenates a cache, and GPT-2 in bench/hf_models.py)."""

from __future__ import annotations

from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm_ffi.structural import structural_walk

from grape_tvm.passes.injective_schedule import RowsOfStaticWidth
from grape_tvm.passes.symbolic_width_schedule import RowsOfSymbolicWidth
from test_passes import CUDA, fused_kernel_of


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
    return fused_kernel_of(lambda past, new: relax.op.concat([past, new], axis=2),
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
    static = fused_kernel_of(lambda x: relax.op.add(x, x), relax.TensorType((8, 64), "float32"))
    narrow = fused_kernel_of(lambda x: relax.op.add(x, x), relax.TensorType((n, 16), "float32"))
    assert RowsOfStaticWidth().apply(static, CUDA, False) is None
    assert RowsOfStaticWidth().apply(narrow, CUDA, False) is None


def test_rows_wider_than_a_block_loop_over_their_part_in_each_thread():
    n = tirx.Var("n", "int64")
    for width, threads in ((1536, 768), (6144, 1024)):
        sch = RowsOfStaticWidth().apply(
            fused_kernel_of(lambda x: relax.op.add(x, x), relax.TensorType((n, width), "float32")),
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
    odd = fused_kernel_of(lambda x: relax.op.add(x, x), relax.TensorType((n, 50257), "float32"))
    assert RowsOfStaticWidth().apply(odd, CUDA, False) is None  # no multiple of 32 divides it


def _scores_scale_and_mask() -> tirx.PrimFunc:
    """Attention's scores scaled and masked, (b, 12, s, s) + (b, 1, s, s), as GPT-2's prefill."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    scale = relax.const(0.125, "float16")
    return fused_kernel_of(lambda x, m: relax.op.add(relax.op.multiply(x, scale), m),
                           relax.TensorType((b, 12, s, s), "float16"),
                           relax.TensorType((b, 1, s, s), "float16"))


def test_rows_of_symbolic_width_stride_a_row_over_a_block_without_symbolic_division():
    sch = RowsOfSymbolicWidth().apply(_scores_scale_and_mask(), CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    assert _symbolic_divisions(scheduled) == []
    text = scheduled.script()
    for axis in ("blockIdx.x", "blockIdx.y", "threadIdx.x"):
        assert axis in text, axis
    fallback = dl.gpu.Fallback().apply(_scores_scale_and_mask(), CUDA, False).mod["main"]
    assert _symbolic_divisions(fallback)
    assert RowsOfStaticWidth().apply(_scores_scale_and_mask(), CUDA, False) is None
    assert RowsOfSymbolicWidth().apply(_cache_concat(), CUDA, False) is None  # static width


def test_a_static_number_of_rows_of_symbolic_width_is_left_to_the_fallback():
    """A decode step's scores (b, 12, 1, past) and Wav2Vec2's expand_dims of (b, samples):
    a block per row would be a few blocks for the whole GPU."""
    b, p = tirx.Var("b", "int64"), tirx.Var("p", "int64")
    scores = fused_kernel_of(lambda x: relax.op.multiply(x, relax.const(0.125, "float32")),
                             relax.TensorType((b, 12, 1, p), "float32"))
    audio = fused_kernel_of(lambda x: relax.op.expand_dims(x, 1),
                            relax.TensorType((b, p), "float32"))
    for func in (scores, audio):
        assert RowsOfSymbolicWidth().apply(func, CUDA, False) is None
