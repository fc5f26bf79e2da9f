"""A concatenation takes its injective producers: a decode step's new key and value rows are
written into the cache's concatenation by the kernel that slices them out of the qkv product."""

from __future__ import annotations

from tvm import IRModule, ir, s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.ir.transform import PassContext, module_pass
from tvm_ffi.structural import structural_walk

from .op_pattern import opaque_as_injective


def single_spatial_store(func: tirx.PrimFunc) -> tirx.BufferStore | None:
    """The store of ``func``'s one block, where that block iterates over spatial iterators
    only and stores one element (a legalized concat, slice, reshape or transpose)."""
    blocks = []
    structural_walk(func.body, ((s_tir.SBlock, blocks.append),))
    body = [b for b in blocks if b.name_hint != "root"]
    if len(body) != 1 or any(var.iter_type != tirx.IterVar.DataPar
                             for var in body[0].iter_vars) or \
            not isinstance(body[0].body, tirx.BufferStore):
        return None
    return body[0].body


def is_concatenation(func: tirx.PrimFunc) -> bool:
    """One block over spatial iterators only, storing a choice (``if_then_else``) among
    loads of other buffers: TVM's legalized ``concat`` (which its pattern analysis calls
    opaque, each element reading one of several inputs)."""
    store = single_spatial_store(func)
    if store is None:
        return False
    output = store.buffer

    def choice_of_inputs(value) -> bool:
        if isinstance(value, TensorLoad):
            return not value.source.same_as(output)
        if isinstance(value, ir.Call) and value.op.name in ("prim.if_then_else", "tirx.if_then_else"):
            return all(choice_of_inputs(arm) for arm in value.args[1:])
        return False

    return isinstance(store.value, ir.Call) and choice_of_inputs(store.value)


@module_pass(opt_level=0, name="FuseIntoConcatenations")
class FuseIntoConcatenations:
    """Annotate a concatenation's PrimFunc (``is_concatenation``) as injective, not opaque,
    so that ``FuseOps`` fuses its injective producers into it. Between
    ``AnnotateTIROpPattern`` and ``FuseOps``.

    A decode step's cache is ``concat(past, new)`` on the keys' axis, the new rows sliced
    and transposed out of the qkv product: one kernel writes them out, the concatenation's
    reads them back. In GPT-2's fp32 decode step at past 256 those were 24 kernels of 2.2
    to 2.3 us each under ncu, 54 us of the step's 638
    (bench/results/gpt2_step_kernels.2809e69.json).

    Before::

        k = R.call_tir(fused_strided_slice_transpose, (qkv,))  # (b, 12, 1, 64)
        present = R.call_tir(concatenate, (past, k))           # op_pattern: kOpaque

    After ``FuseOps`` and ``FuseTIR``::

        present = R.call_tir(fused_strided_slice_transpose_concatenate, (qkv, past))
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        return opaque_as_injective(mod, is_concatenation)

