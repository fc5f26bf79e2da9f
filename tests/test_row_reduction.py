"""grape's GPU rule for row reductions over the rows of a sequence
(``passes/row_reduction.py``), on tiny modules: the schedule it makes, and what it leaves to
dlight's ``GeneralReduction``. On the GPU its kernels run in GPT-2's prefill and Wav2Vec2
(``bench/hf_models.py``, outputs against PyTorch's); no model of tests/test_gpu.py has rows
of a sequence."""

from __future__ import annotations

from tvm import relax, tirx
from tvm_ffi.structural import structural_walk

from grape_tvm.passes.row_reduction import WARP, RowReductionPerWarp
from test_passes import CUDA, fused_kernel_of


def _thread_extents(func: tirx.PrimFunc) -> dict:
    """Each thread tag's loop extents (several loops may bind one tag)."""
    found: dict = {}

    def visit(loop):
        if loop.thread_binding is not None:
            found.setdefault(loop.thread_binding.thread_tag, []).append(loop.extent)
    structural_walk(func.body, ((tirx.For, visit),))
    return found


def test_softmax_and_layer_norm_over_symbolic_rows_get_a_warp_per_row():
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    softmax = fused_kernel_of(lambda x: relax.op.nn.softmax(x, -1),
                              relax.TensorType((b, 12, s, s), "float16"))
    norm = fused_kernel_of(lambda x, w, c: relax.op.nn.layer_norm(x, w, c, [-1]),
                           relax.TensorType((b, s, 768), "float32"),
                           relax.TensorType((768,), "float32"), relax.TensorType((768,), "float32"))
    for func, rows in ((softmax, "b * s * T.int64(12)"), (norm, "b * s")):
        sch = RowReductionPerWarp().apply(func, CUDA, False)
        assert sch is not None
        threads = _thread_extents(sch.mod["main"])
        # every loop over a row (the max, the sum, the quotient) is one warp's lanes
        assert len(threads["threadIdx.x"]) == 3
        assert all(int(extent) == WARP for extent in threads["threadIdx.x"])
        (blocks,) = threads["blockIdx.x"]  # a block per row
        assert str(blocks) == rows  # the kernel's own dims b and s


def test_rows_of_a_batch_alone_are_left_to_general_reduction():
    """A decode step's: b rows of layer norm, b x 12 rows of softmax over the past."""
    b, past = tirx.Var("b", "int64"), tirx.Var("past", "int64")
    decode_softmax = fused_kernel_of(lambda x: relax.op.nn.softmax(x, -1),
                                     relax.TensorType((b, 12, 1, past), "float32"))
    decode_norm = fused_kernel_of(lambda x, w, c: relax.op.nn.layer_norm(x, w, c, [-1]),
                                  relax.TensorType((b, 1, 768), "float32"),
                                  relax.TensorType((768,), "float32"),
                                  relax.TensorType((768,), "float32"))
    static_rows = fused_kernel_of(lambda x: relax.op.nn.softmax(x, -1),
                                  relax.TensorType((1, 12, 1, 64), "float32"))
    for func in (decode_softmax, decode_norm, static_rows):
        assert RowReductionPerWarp().apply(func, CUDA, False) is None


def test_a_reduction_over_another_axis_than_the_rows_is_left_alone():
    """softmax over axis 1 of (b, s, s): its reductions are not one element of a row."""
    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    other_axis = fused_kernel_of(lambda x: relax.op.nn.softmax(x, 1),
                                 relax.TensorType((b, s, s), "float32"))
    assert RowReductionPerWarp().apply(other_axis, CUDA, False) is None
