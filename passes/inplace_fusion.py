"""An in-place write takes the data-movement kernels that produce what it writes: a decode
step's new key and value rows are sliced out of the qkv product by the kernel that writes
them into a static cache."""

from __future__ import annotations

from tvm import IRModule, relax, tirx
from tvm.ir import Op
from tvm.ir.expr import TensorLoad
from tvm.ir.transform import PassContext, module_pass

from .concat_fusion import single_spatial_store
from .op_pattern import INJECTIVE
from .var_reads import emit_as, read_counts

_CALL_TIR = Op.get("relax.call_tir")
_CALL_TIR_INPLACE = Op.get("relax.call_tir_inplace")


def moves_data(func: tirx.PrimFunc) -> bool:
    """An injective kernel by TVM's op pattern (element-wise to injective), or one storing a
    load of another buffer over spatial iterators (a legalized slice, reshape or transpose):
    TVM calls a reshape over a symbolic dim opaque (its index wraps by the dim), hence the
    second test."""
    pattern = func.attrs.get("op_pattern") if func.attrs is not None else None
    if pattern is not None and int(pattern) <= INJECTIVE:
        return True
    store = single_spatial_store(func)
    return store is not None and isinstance(store.value, TensorLoad) and \
        not store.value.source.same_as(store.buffer)


def _dims(param) -> list:
    """A PrimFunc buffer parameter's dims: their integer types and static extents."""
    return [(str(d.ty), int(d) if isinstance(d, tirx.IntImm) else None) for d in param.shape]


@relax.expr_functor.mutator
class _Grouper(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.mod = mod
        self.grouped = 0
        self.start(None)

    def start(self, func: relax.Function | None) -> None:
        """Before visiting ``func``: its reads, and no binding seen yet."""
        self.reads = read_counts(func) if func is not None else {}
        self.position = 0  # of the binding being visited, in the function
        self.bound_at: dict[relax.Var, int] = {}
        self.written: dict[relax.Var, int] = {}  # written in place: where, the last time

    def _primfunc(self, gvar) -> tirx.PrimFunc | None:
        func = self.mod[gvar] if isinstance(gvar, relax.GlobalVar) else None
        return func if isinstance(func, tirx.PrimFunc) else None

    def _producers(self, value: relax.Expr) -> list[relax.VarBinding]:
        """The chain of single-input data-movement ``call_tir`` bindings ``value`` comes
        through, last first, each of them read only by the next."""
        chain = []
        while isinstance(value, relax.DataflowVar) and self.reads.get(value, 0) == 1:
            bound = self.lookup_binding(value)
            if not (isinstance(bound, relax.Call) and bound.op == _CALL_TIR and
                    len(bound.args) == 2 and len(bound.args[1].fields) == 1):
                break
            func = self._primfunc(bound.args[0])
            if func is None or not moves_data(func):
                break
            chain.append(relax.VarBinding(value, bound))
            value = bound.args[1].fields[0]
        return chain

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self.position += 1
        self.bound_at[binding.var] = self.position
        call = binding.value
        if not (isinstance(call, relax.Call) and call.op == _CALL_TIR_INPLACE and
                len(call.args) == 2 and isinstance(call.args[1], relax.Tuple)):
            super().visit_var_binding_(binding)
            return
        self._visit_write(binding)
        for index in call.attrs.inplace_indices:
            written = call.args[1].fields[int(index)]
            if isinstance(written, relax.Var):
                self.written[written] = self.position

    def _takes(self, chain: list, args: list, inplace: set, writer, index: int) -> bool:
        """Whether the write may read its argument ``index`` through ``chain`` (last first)
        itself: what the chain reads is neither written by the call (a kernel reading and
        writing one buffer through other indices races) nor written in place since the
        chain's first kernel ran (the group runs where the write was), and FuseTIR can map
        each kernel's output buffer onto the next one's input, to the dims' integer types
        (a hand-written int32 shape does not map onto Relax's int64 ones)."""
        root = chain[-1].value.args[1].fields[0]
        if any(root.same_as(args[i]) for i in inplace) or \
                self.written.get(root, -1) > self.bound_at.get(chain[-1].var, self.position):
            return False
        kernels = [self._primfunc(b.value.args[0]) for b in chain]
        links = [(k.params[-1], writer.params[index]) for k in kernels[:1]] + \
            [(outer.params[-1], inner.params[0]) for inner, outer in zip(kernels, kernels[1:])]
        return all(_dims(a) == _dims(b) for a, b in links)

    def _visit_write(self, binding: relax.VarBinding) -> None:
        call = binding.value
        writer = self._primfunc(call.args[0])
        inplace = {int(i) for i in call.attrs.inplace_indices}
        args = list(call.args[1].fields)
        taken = None
        for index, arg in enumerate(args):
            chain = [] if writer is None or index in inplace else self._producers(arg)
            if chain and self._takes(chain, args, inplace, writer, index):
                taken = (index, chain)
                break
        grouped = None if taken is None else self._grouped(call, *taken)
        if grouped is None:
            super().visit_var_binding_(binding)
            return
        self.set_var_remap(binding.var, emit_as(self.builder_, binding.var, grouped))

    def _grouped(self, call: relax.Call, index: int, chain: list) -> relax.Call | None:
        """A call of a new primitive function running ``chain`` and then ``call``, its
        parameters ``call``'s arguments with argument ``index`` read through ``chain``; None
        where a kernel of the chain has a dim the parameters do not define."""
        args = list(call.args[1].fields)
        root = chain[-1].value.args[1].fields[0]
        params = [relax.Var(f"arg{i}", (root if i == index else a).ty) for i, a in enumerate(args)]
        # named as FuseOps names its groups: the kernels' names in order
        name = "_".join(["fused"] + [p.value.args[0].name_hint for p in reversed(chain)] +
                        [call.args[0].name_hint])
        bb = relax.BlockBuilder()
        with bb.function(name, params, attrs={"Primitive": True}, private=True):
            with bb.dataflow():
                value = params[index]
                for produced in reversed(chain):
                    value = bb.emit(relax.call_tir(produced.value.args[0], (value,),
                                                   produced.value.ty))
                inner = params[:index] + [value] + params[index + 1:]
                out = bb.emit_output(relax.call_tir_inplace(
                    call.args[0], inner, [int(i) for i in call.attrs.inplace_indices],
                    call.ty))
            bb.emit_func_output(out)
        # its own symbolic dims: a variable is defined in one function only
        func = relax.utils.copy_with_new_vars(bb.get()[name])
        if relax.analysis.free_symbolic_vars(func):
            return None
        gvar = self.builder_.add_func(func, name)
        self.grouped += 1
        new_args = [self.visit_expr(a) for a in args[:index]] + [self.visit_expr(root)] + \
            [self.visit_expr(a) for a in args[index + 1:]]
        return relax.Call(gvar, new_args)


@module_pass(opt_level=0, name="FuseIntoInplaceWrites")
class FuseIntoInplaceWrites:
    """Group a ``call_tir_inplace`` with the single-input injective kernels (``moves_data``:
    slices, reshapes, transposes, element-wise ops) that produce one of its written-from
    arguments into a primitive function, which ``FuseTIR`` makes one kernel. Between
    ``AnnotateTIROpPattern`` and ``FuseOps``: TVM's ``FuseOps`` stops at a reshape over a
    symbolic batch, which its pattern analysis calls opaque. Declined where the group would
    read what the write writes, or what an in-place call since the chain's first kernel
    wrote (the group runs where the write was), or a dim its parameters do not define.

    A decode step with a static cache writes its new key and value rows in place at the
    position (``cache[b, h, pos, :] = new[b, h, :]``); the rows are sliced out of the qkv
    product and reshaped to heads, a kernel each. In the decode-loop benchmark's decoder
    those were 8 of its 59 kernels a step (``bench/models.py: decoder_step``).

    Before::

        k = R.call_tir(strided_slice1, (qkv,))              # (b, 256)
        k_heads = R.call_tir(reshape, (k,))                 # (b, 4, 64)
        k0 = R.call_tir_inplace(write_cache, (cache, k_heads, pos), inplace_indices=[0])

    After (``FuseTIR`` then makes the primitive function one PrimFunc)::

        k0 = fused_strided_slice1_reshape_write_cache(cache, qkv, pos)  # the three calls
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        grouper = _Grouper(mod)
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or \
                    (func.attrs is not None and "Primitive" in func.attrs):
                continue
            before = grouper.grouped
            grouper.start(func)
            new = grouper.visit_expr(func)
            if grouper.grouped > before:
                grouper.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
        return grouper.builder_.get() if grouper.grouped else mod
