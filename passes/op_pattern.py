"""TVM's op patterns (``op_pattern`` of a PrimFunc, include/tvm/relax/op_attr_types.h) as the
fusion passes read and change them: which kernels ``FuseOps`` may fuse."""

from __future__ import annotations

from tvm import IRModule, ir, relax, tirx

INJECTIVE, OPAQUE = 2, 8
_CALL_TIR_INPLACE = ir.Op.get("relax.call_tir_inplace")


def opaque_as_injective(mod: IRModule, qualifies) -> IRModule:
    """``mod`` with each PrimFunc annotated opaque that ``qualifies`` annotated injective,
    except those called in place (``call_tir_inplace``): FuseTIR cannot fuse an in-place
    call with its neighbours (its output is an input's buffer)."""
    in_place = called_in_place(mod)
    updates = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None and \
                int(func.attrs.get("op_pattern", -1)) == OPAQUE and \
                gvar.name_hint not in in_place and qualifies(func):
            updates[gvar] = func.with_attr("op_pattern", INJECTIVE)
    if not updates:
        return mod
    return IRModule({**dict(mod.functions), **updates}, attrs=mod.attrs,
                    global_infos=mod.global_infos)


def called_in_place(mod: IRModule) -> set[str]:
    """The names of the PrimFuncs some Relax function of ``mod`` calls in place."""
    names: set[str] = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op == _CALL_TIR_INPLACE:
            names.add(expr.args[0].name_hint)

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    return names
