"""A reduction writes its identity before its loops: an empty reduction returns it."""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.transform import PassContext
from tvm.s_tir import Schedule
from tvm.s_tir.schedule.schedule import ScheduleError
from tvm.tirx.transform import prim_func_pass


@prim_func_pass(opt_level=0, name="HoistReductionInit")
class HoistReductionInit:
    """Move each reduction block's init in front of its reduction loops.

    TVM lowers a block's ``T.init()`` to ``if k == 0: init`` inside the reduction loop
    (``LowerInitBlock``): over a dim of size 0 the loop body never runs, and the output
    keeps whatever its buffer held (``ReduceSum`` over an empty dim returned 1.1e-44, not
    0). ``decompose_reduction`` at the outermost reduction loop writes the identity (0 for
    a sum, 1 for a product, -inf for a max, the reduction's own init) over the output's
    spatial loops first, then reduces into it: the same values for a non-empty reduction,
    the identity for an empty one. For PrimFuncs not scheduled yet (TVM's CPU lowering
    schedules none); on a GPU dlight schedules reductions itself and needs their init
    blocks, so the GPU pipeline does not run this. A block the primitive refuses is left
    as it was.

    Before::

        for ax0, k0 in T.grid(T.int64(4), n):
            with T.sblock("x_red"):
                v_ax0, v_k0 = T.axis.remap("SR", [ax0, k0])
                with T.init():
                    x_red[v_ax0] = T.float32(0.0)
                x_red[v_ax0] = x_red[v_ax0] + x[v_k0, v_ax0]

    After::

        for ax0 in range(T.int64(4)):
            with T.sblock("x_red_init"):
                v_ax0 = T.axis.spatial(T.int64(4), ax0)
                x_red[v_ax0] = T.float32(0.0)
            for k0 in range(n):
                with T.sblock("x_red_update"):
                    v_ax0, v_k0 = T.axis.remap("SR", [ax0, k0])
                    x_red[v_ax0] = x_red[v_ax0] + x[v_k0, v_ax0]
    """

    def transform_function(self, func: tirx.PrimFunc, mod: tvm.IRModule,
                           ctx: PassContext) -> tirx.PrimFunc:
        if func.attrs is not None and func.attrs.get("tirx.is_scheduled", False):
            return func
        try:
            sch = Schedule(func)
            blocks = sch.get_child_blocks(sch.get_sblock("root"))
        except (ScheduleError, tvm.error.InternalError, ValueError):
            return func  # no root block: not a PrimFunc of TVM's legalization
        changed = False
        for block in blocks:
            if sch.get(block).init is None:
                continue
            # Innermost first: the first loop the primitive takes is the outermost one a
            # reduction iterator is bound to (the ones below it are refused).
            for loop in reversed(sch.get_loops(block)):
                try:
                    sch.decompose_reduction(block, loop)
                except ScheduleError:
                    continue
                changed = True
                break
        return sch.mod["main"] if changed else func
