"""How much memory planning set aside: the storages sized at the declared upper bounds."""

from __future__ import annotations

import math

import tvm
from tvm import relax

_ALLOC_STORAGE = ("relax.memory.alloc_storage", "relax.vm.alloc_storage")


def planned_bytes(mod: tvm.IRModule) -> int:
    """Bytes of the storages of every Relax function of ``mod`` whose size is a constant.

    After ``StaticPlanBlockMemory``, an intermediate tensor with symbolic dims lives in a
    storage of constant size, computed at the dims' ``tir_var_upper_bound``: a call at any
    shape allocates all of it. A storage sized at run time (an output's) is not counted: a
    call allocates only what its shape needs. Storages of different functions are summed,
    as if all were live at once, so the figure never falls short.

    Before ``VMShapeLower`` (``R.memory``) or after it (``R.vm``)::

        storage = R.vm.alloc_storage(R.shape([256000]), 0, R.dtype("uint8"), "global")
    """
    ops = {tvm.ir.Op.get(name) for name in _ALLOC_STORAGE}
    sizes: list[int] = []

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call) and expr.op in ops:
            size = expr.args[0]
            if isinstance(size, relax.ShapeExpr) and \
                    all(isinstance(v, tvm.tirx.IntImm) for v in size.values):
                sizes.append(math.prod(int(v) for v in size.values))

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return sum(sizes)
