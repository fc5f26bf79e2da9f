"""A kernel's minimum of resident blocks an SM (``__launch_bounds__``'s second argument),
carried from the schedule to the kernel function TVM generates."""

from __future__ import annotations

import tvm
from tvm import ir, tirx
from tvm.ir.transform import PassContext
from tvm.tirx.transform import prim_func_pass
from tvm_ffi.structural import structural_mutate

# TVM's attribute of a kernel function: its CUDA codegen writes it as the second argument
# of __launch_bounds__. SplitHostDevice does not carry a PrimFunc's attribute to the kernels
# it makes, so a pass before it marks the kernel's body instead (``min_blocks_mark``).
MIN_BLOCKS_PER_SM = "tirx.launch_bounds_min_blocks_per_sm"
MIN_BLOCKS_MARK = "grape_min_blocks_per_sm"


def min_blocks_mark(blocks: int, body: tirx.Stmt) -> tirx.Stmt:
    """``body`` (inside a kernel's outermost thread binding) asking for at least ``blocks``
    blocks an SM."""
    return tirx.AttrStmt(ir.StringImm(MIN_BLOCKS_MARK), MIN_BLOCKS_MARK,
                         tirx.IntImm("int32", blocks), body)


@prim_func_pass(opt_level=0, name="KernelLaunchBounds")
class KernelLaunchBounds:
    """A device kernel whose body is marked by ``min_blocks_mark`` gets TVM's attribute for
    the minimum of blocks an SM, and the mark goes. For the kernel functions of
    ``SplitHostDevice`` (grape's TIR pipeline runs it on them before codegen)::

        # before
        @T.prim_func
        def gemv_kernel(...):
            T.func_attr({"calling_conv": 2, ...})
            with T.attr("grape_min_blocks_per_sm", "grape_min_blocks_per_sm", 2):
                ...

        # after
        @T.prim_func
        def gemv_kernel(...):
            T.func_attr({"calling_conv": 2, ..., "tirx.launch_bounds_min_blocks_per_sm": 2})
            ...

    and its CUDA source reads ``__launch_bounds__(256, 2)``. A mark that reaches codegen
    (TVM's own TIR pipeline) is ignored there: the kernel keeps ptxas's default.
    """

    def transform_function(self, func: tirx.PrimFunc, _mod: tvm.IRModule,
                           _ctx: PassContext) -> tirx.PrimFunc:
        found = []

        def on_attr(stmt, mutator):
            if stmt.attr_key != MIN_BLOCKS_MARK:
                return mutator.default_mutate(stmt)
            found.append(int(stmt.value))
            return mutator.mutate(stmt.body)

        body = structural_mutate(func.body, ((tirx.AttrStmt, on_attr),))
        if not found:
            return func
        return func.with_body(body).with_attr(MIN_BLOCKS_PER_SM, max(found))
