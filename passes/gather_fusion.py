"""A gather (``take``: an embedding lookup) fuses with its neighbours like any injective op."""

from __future__ import annotations

from tvm import IRModule, tirx
from tvm.ir.expr import TensorLoad
from tvm.ir.transform import PassContext, module_pass
from tvm_ffi.structural import structural_walk

from .concat_fusion import single_spatial_store
from .op_pattern import opaque_as_injective


def is_gather(func: tirx.PrimFunc) -> bool:
    """One block over spatial iterators only, storing one element of another buffer at an
    index read from a third: TVM's legalized ``take`` (which its pattern analysis calls
    opaque, an element's address depending on data)."""
    store = single_spatial_store(func)
    if store is None or not isinstance(store.value, TensorLoad):
        return False
    table = store.value.source
    if table.same_as(store.buffer):
        return False
    index_reads = []
    for index in store.value.indices:
        structural_walk(index, ((TensorLoad, index_reads.append),))
    return bool(index_reads) and all(not load.source.same_as(b)
                                     for load in index_reads for b in (table, store.buffer))


@module_pass(opt_level=0, name="FuseGathers")
class FuseGathers:
    """Annotate a gather's PrimFunc (``is_gather``) as injective, not opaque, so that
    ``FuseOps`` fuses it with its element-wise consumers and producers, as Relay's
    ``take`` (``kInjective``) was. Between ``AnnotateTIROpPattern`` and ``FuseOps``.

    Fused, an element reads the table at the gathered row where the consumer reads the
    gather's output: ``out[i, j] = wte[token[i], j] + wpe[pos[0], j]`` is one kernel. A
    decode step's embeddings were three kernels of about 2.2 to 2.5 us under ncu (GPT-2,
    bench/results/gpt2_step_kernels.json; the decode-loop decoder likewise).

    Before::

        lv = R.call_tir(take, (wte, token))    # op_pattern: kOpaque
        lv1 = R.call_tir(take1, (wpe, pos))    # op_pattern: kOpaque
        h = R.call_tir(add, (lv, lv1))

    After ``FuseOps`` and ``FuseTIR``::

        h = R.call_tir(fused_take_take1_add, (wte, token, wpe, pos))
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        return opaque_as_injective(mod, is_gather)
