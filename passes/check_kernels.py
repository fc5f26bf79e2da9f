"""Refuse GPU builds in which a kernel silently stayed on the host."""

from __future__ import annotations

from tvm import IRModule, tirx
from tvm.sym import Analyzer
from tvm_ffi.structural import WalkResult, structural_walk
from tvm.ir.transform import PassContext, module_pass


class HostFallbackError(RuntimeError):
    """A GPU build left kernels, or loops launching them, without a thread binding: they
    would run on the CPU.

    Raised inside a pass, it reaches Python through TVM's FFI as a plain error with the
    same text; ``grape_tvm.build`` gives it back its type.
    """

    MARK = "the GPU build left these kernels without a thread binding"


def _launches_threads(stmt: tirx.Stmt) -> bool:
    found = []

    def on_for(loop):
        if loop.thread_binding is not None:
            found.append(loop)

    def on_attr(stmt):
        if stmt.attr_key == "thread_extent":
            found.append(stmt)

    structural_walk(stmt, ((tirx.For, on_for), (tirx.AttrStmt, on_attr)))
    return bool(found)


def _stores_outside_threads(func: tirx.PrimFunc) -> int:
    """Buffer stores not under any thread binding: what codegen leaves to the host."""
    stores = []

    def on_for(loop):
        return WalkResult.SKIP if loop.thread_binding is not None else WalkResult.ADVANCE

    def on_attr(stmt):
        return WalkResult.SKIP if stmt.attr_key == "thread_extent" else WalkResult.ADVANCE

    def on_store(stmt):
        stores.append(stmt)
        return WalkResult.ADVANCE

    structural_walk(func.body, ((tirx.For, on_for), (tirx.AttrStmt, on_attr),
                                (tirx.BufferStore, on_store)), order="pre")
    return len(stores)


def _launches_from_host_loops(func: tirx.PrimFunc) -> bool:
    """A loop outside every thread binding, of more than one iteration, around one: codegen
    makes the binding a kernel and the loop a host loop launching it once per iteration.

    Loops inside a binding are device code; a unit loop outside one (dlight adds them)
    launches once.
    """
    analyzer = Analyzer()
    found = []

    def on_for(loop):
        if loop.thread_binding is not None:
            return WalkResult.SKIP  # a kernel starts here: what is inside runs on the device
        if not analyzer.can_prove(loop.extent <= 1) and _launches_threads(loop.body):
            found.append(loop)
            return WalkResult.SKIP
        return WalkResult.ADVANCE

    def on_attr(stmt):
        return WalkResult.SKIP if stmt.attr_key == "thread_extent" else WalkResult.ADVANCE

    structural_walk(func.body, ((tirx.For, on_for), (tirx.AttrStmt, on_attr)), order="pre")
    return bool(found)


def _is_host_function(func: tirx.PrimFunc) -> bool:
    attrs = func.attrs
    if attrs is None:
        return False
    if "target" in attrs and attrs["target"].kind.name in ("llvm", "c"):
        return True
    return bool(attrs.get("tirx.is_host_func", False))


def _touches_memory(func: tirx.PrimFunc) -> bool:
    return len(func.params) > 0


def unbound_kernels(mod: IRModule) -> list[str]:
    """Names of PrimFuncs that a GPU target would quietly compile for the host."""
    names = []
    for gvar, func in mod.functions.items():
        if not isinstance(func, tirx.PrimFunc) or _is_host_function(func):
            continue
        # No thread at all, a part (a padding copy, say) left outside the threads, or a
        # kernel launched from a host loop, once per iteration.
        if _touches_memory(func) and (not _launches_threads(func.body)
                                      or _stores_outside_threads(func)
                                      or _launches_from_host_loops(func)):
            names.append(gvar.name_hint)
    return sorted(names)


@module_pass(opt_level=0, name="CheckDeviceKernels")
class CheckDeviceKernels:
    """Fail a GPU build when a kernel has no ``blockIdx``/``threadIdx`` binding.

    TVM's GPU schedules (dlight) skip a PrimFunc they cannot handle; codegen then quietly
    compiles it for the host and the build still succeeds, with the model reading device
    memory from the CPU at run time. This pass makes that an error naming the functions.

    Before (the pass raises)::

        @T.prim_func
        def softmax(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
            for i in range(n):          # no thread binding: would run on the host
                y[i] = ...

    A kernel bound to threads only in part (a block a schedule rule left as serial loops
    beside the bound ones) is refused too: those loops would run on the host as well. So is
    a binding under a loop that has none: the loop runs on the host and launches the kernel
    once per iteration (TVM 0.27's ``GeneralReduction`` on a mean to a scalar)::

        for k0, k1 in T.grid(n, 512):                       # host loops: n * 512 launches
            for u in T.thread_binding(1, thread="blockIdx.x"):
                red[()] = red[()] + x[k0, k1]

    After: a module in which every kernel binds ``blockIdx``/``threadIdx`` is returned as is.
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        bad = unbound_kernels(mod)
        if bad:
            raise HostFallbackError(
                f"{HostFallbackError.MARK} (wholly, in part, or in the loops around a launch), "
                "so TVM would run those loops on the host: "
                f"{', '.join(bad)}. No artifact was produced."
            )
        return mod
