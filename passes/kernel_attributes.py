"""Attributes of a device kernel chosen before ``SplitHostDevice`` (which does not carry a
PrimFunc's attributes to the kernels it makes), carried to the kernel function TVM generates:
the schedule marks the kernel's body, ``KernelAttributes`` moves the mark onto the kernel."""

from __future__ import annotations

import tvm
from tvm import ir, tirx
from tvm.ir.transform import PassContext
from tvm.tirx.transform import prim_func_pass
from tvm_ffi.structural import structural_mutate

# TVM's attributes of a kernel function, as its CUDA codegen reads them: the second argument
# of __launch_bounds__, and whether the kernel's pointer parameters are __restrict__.
MIN_BLOCKS_PER_SM = "tirx.launch_bounds_min_blocks_per_sm"
NO_ALIAS = "tirx.noalias"
KERNEL_ATTRIBUTE_MARK = "grape_kernel_attribute"


def kernel_attribute_mark(key: str, value: int, body: tirx.Stmt) -> tirx.Stmt:
    """``body`` (inside a kernel's outermost thread binding) asking for the kernel attribute
    ``key`` = ``value``."""
    return tirx.AttrStmt(ir.StringImm(key), KERNEL_ATTRIBUTE_MARK, tirx.IntImm("int32", value),
                         body)


def min_blocks_mark(blocks: int, body: tirx.Stmt) -> tirx.Stmt:
    """``body`` asking for at least ``blocks`` resident blocks an SM."""
    return kernel_attribute_mark(MIN_BLOCKS_PER_SM, blocks, body)


def coherent_loads_mark(body: tirx.Stmt) -> tirx.Stmt:
    """``body`` asking for pointer parameters without ``__restrict__``: nvcc then reads
    through them with coherent loads, never ``ld.global.nc``."""
    return kernel_attribute_mark(NO_ALIAS, 0, body)


@prim_func_pass(opt_level=0, name="KernelAttributes")
class KernelAttributes:
    """A device kernel whose body holds ``kernel_attribute_mark``s gets their attributes,
    and the marks go. For the kernel functions of ``SplitHostDevice`` (grape's TIR pipeline
    runs it on them before codegen)::

        # before
        @T.prim_func
        def gemv_kernel(w: T.handle, ...):
            T.func_attr({"calling_conv": 2, "tirx.noalias": True, ...})
            with T.attr("tirx.launch_bounds_min_blocks_per_sm", "grape_kernel_attribute", 2):
                with T.attr("tirx.noalias", "grape_kernel_attribute", 0):
                    ...

        # after
        @T.prim_func
        def gemv_kernel(w: T.handle, ...):
            T.func_attr({"calling_conv": 2, "tirx.noalias": False, ...,
                         "tirx.launch_bounds_min_blocks_per_sm": 2})
            ...

    and its CUDA source reads ``__launch_bounds__(256, 2) gemv_kernel(float* w_ptr, ...)``.
    Two marks of one attribute must agree. A mark that reaches codegen (TVM's own TIR
    pipeline) is ignored there: the kernel keeps TVM's attributes.
    """

    def transform_function(self, func: tirx.PrimFunc, _mod: tvm.IRModule,
                           _ctx: PassContext) -> tirx.PrimFunc:
        found: dict[str, int] = {}

        def on_attr(stmt, mutator):
            if stmt.attr_key != KERNEL_ATTRIBUTE_MARK:
                return mutator.default_mutate(stmt)
            key, value = stmt.node.value, int(stmt.value)
            if found.setdefault(key, value) != value:
                raise ValueError(f"kernel attribute {key} marked both {found[key]} and {value}")
            return mutator.mutate(stmt.body)

        body = structural_mutate(func.body, ((tirx.AttrStmt, on_attr),))
        if not found:
            return func
        attrs = {k: bool(v) if k == NO_ALIAS else v for k, v in found.items()}
        return func.with_body(body).with_attrs(attrs)
