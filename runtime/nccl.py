"""NCCL's collectives for the functions ``passes.CollectivesAsLibraryCalls`` calls, captured
into grape's graphs.

A rank's program (``grape_tvm.build(..., tensor_parallel=N)``) all-reduces the partial sums of
its row-parallel matmuls. TVM lowers ``R.ccl.allreduce`` to a call of disco's builtin, which
grape's regions cannot hold (a host step between two graphs); the compiler rewrites it into
``R.call_dps_packed("grape.nccl.allreduce_sum", (x,), ...)`` instead (``COLLECTIVE_FUNCTIONS``:
the name says the collective and the reduction), a library kernel like cuBLASLt's matmuls.

On CUDA the function runs ``ncclAllReduce`` on the stream TVM is capturing, with the
communicator of the backend that is capturing (``NcclCommunicator.active``): NCCL supports
stream capture, so the collective's kernel is a node of the region's graph. A backend makes
its communicator from the ``CollectiveGroup`` it is given (the rank, the world size and the
unique id rank 0 made: ``TensorParallelSession`` hands them out) and owns it. On the CPU the
function calls disco's builtin (``runtime.disco.allreduce``): the collectives of the disco
session the rank runs in.

Needs ``libnccl``: one the process or the system has, else the ``nvidia-nccl`` package's.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

from .active import ThreadInstances, load_shared_library, packaged_libraries, register_once

LIBRARY = "nccl"  # its name in a plan's "libraries" (what the runtime must provide)
FUNCTION_PREFIX = f"grape.{LIBRARY}."
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
_LIBRARIES = ("libnccl.so.2", "libnccl.so")

# nccl.h's enums. disco numbers the reductions otherwise (its builtin's op codes: TVM's
# legalization of R.ccl.allreduce), min and max swapped.
_NCCL_REDUCTIONS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_DISCO_REDUCTIONS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "avg": 4}
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}


class NcclError(RuntimeError):
    """An NCCL call failed, or no communicator is there to run a collective."""


@dataclass(frozen=True)
class CollectiveFunction:
    """One packed function of the library: an all-reduce with its reduction, or an
    all-gather (along the first axis, as ``R.ccl.allgather``)."""

    collective: str  # "allreduce" or "allgather"
    reduction: str = ""  # an all-reduce's: a key of _NCCL_REDUCTIONS

    @property
    def name(self) -> str:
        suffix = f"_{self.reduction}" if self.reduction else ""
        return f"{FUNCTION_PREFIX}{self.collective}{suffix}"


COLLECTIVE_FUNCTIONS = {f.name: f for f in (
    [CollectiveFunction("allreduce", r) for r in _NCCL_REDUCTIONS] +
    [CollectiveFunction("allgather")])}


@dataclass(frozen=True)
class CollectiveGroup:
    """What one rank needs to join the others' communicator: its rank, how many there are,
    and the unique id rank 0 made (``unique_id()``), the same for all."""

    rank: int
    world_size: int
    unique_id: bytes

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not one of {self.world_size} ranks")
        if len(self.unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got "
                             f"{len(self.unique_id)}")


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_uint8 * UNIQUE_ID_BYTES)]  # bytes, NULs included


def _library() -> ctypes.CDLL:
    """libnccl: one the process or the system has (by soname), else the ``nvidia-nccl``
    package's."""
    library = load_shared_library(_LIBRARIES, packaged_libraries(("nccl/lib", "cu13/lib"),
                                                                 "libnccl.so*"))
    if library is None:
        raise NcclError("this artifact's collectives run on NCCL, and no libnccl is found "
                        f"here (tried {', '.join(_LIBRARIES)} and the nvidia-nccl package)")
    return library


def _ok(lib: ctypes.CDLL, status: int, call: str) -> None:
    if status != 0:
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        raise NcclError(f"{call} failed: {lib.ncclGetErrorString(status).decode()} "
                        f"(ncclResult_t {status})")


def unique_id() -> bytes:
    """A new communicator's id (``ncclGetUniqueId``), made once by rank 0's side and
    handed to every rank."""
    lib = _library()
    made = _UniqueId()
    _ok(lib, lib.ncclGetUniqueId(ctypes.byref(made)), "ncclGetUniqueId")
    return bytes(made.internal)


class NcclCommunicator:
    """One rank's NCCL communicator on one device, made with that device's primary context
    current (NCCL takes the device from it: a ``CudaGraphBackend`` makes it after setting its
    own). Every rank of the group must make its own at the same time (``ncclCommInitRank``
    waits for all of them). Owns it: ``close`` destroys it."""

    def __init__(self, group: CollectiveGroup):
        self.lib = _library()
        self.group = group
        self.comm = None  # what close() frees
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                              _UniqueId, ctypes.c_int]
        given = _UniqueId.from_buffer_copy(group.unique_id)
        comm = ctypes.c_void_p()
        _ok(self.lib, self.lib.ncclCommInitRank(ctypes.byref(comm), group.world_size, given,
                                                group.rank), "ncclCommInitRank")
        self.comm = comm

    def run(self, function: CollectiveFunction, x, out, stream: int) -> None:
        """``function`` of ``x`` into ``out`` on ``stream`` (captured there when it is)."""
        dtype = _nccl_dtype(x)
        count = math.prod(x.shape)
        if function.collective == "allreduce":
            status = self.lib.ncclAllReduce(
                ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_size_t(count), ctypes.c_int(dtype),
                ctypes.c_int(_NCCL_REDUCTIONS[function.reduction]), self.comm,
                ctypes.c_void_p(stream))
        else:
            status = self.lib.ncclAllGather(
                ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_size_t(count), ctypes.c_int(dtype), self.comm, ctypes.c_void_p(stream))
        _ok(self.lib, status, f"nccl {function.collective}")

    def broadcast(self, x, out, stream: int) -> None:
        """Rank 0's ``x`` into every rank's ``out`` on ``stream`` (``x`` is read on rank 0
        only)."""
        status = self.lib.ncclBroadcast(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_size_t(math.prod(x.shape)), ctypes.c_int(_nccl_dtype(x)), ctypes.c_int(0),
            self.comm, ctypes.c_void_p(stream))
        _ok(self.lib, status, "ncclBroadcast")

    def active(self):
        """Calls of the packed functions on this thread use this communicator meanwhile."""
        return _INSTANCES.activated(self)

    def close(self) -> None:
        """Destroy the communicator; idempotent. Every rank closes its own at the same time
        (``ncclCommDestroy`` may wait for the others: a session closes all its ranks)."""
        if self.comm is None:
            return
        comm, self.comm = self.comm, None
        _ok(self.lib, self.lib.ncclCommDestroy(comm), "ncclCommDestroy")

    def abort(self) -> None:
        """Free the communicator without the other ranks (``ncclCommAbort``): where this rank
        alone lets go of it (an error before its executor was made, collection)."""
        if self.comm is None:
            return
        comm, self.comm = self.comm, None
        self.lib.ncclCommAbort(comm)

    def __del__(self):
        try:
            self.abort()
        except Exception:  # pylint: disable=broad-except
            pass  # interpreter shutdown


def _nccl_dtype(x) -> int:
    dtype = _NCCL_DTYPES.get(str(x.dtype))
    if dtype is None:
        raise NcclError(f"NCCL has no {x.dtype} collectives")
    return dtype


def _no_communicator(device_index: int) -> NcclCommunicator:
    raise NcclError(f"no NCCL communicator is active on this thread for cuda:{device_index}: "
                    "an artifact with collectives runs on its ranks, each loaded with its "
                    "CollectiveGroup (grape_tvm.load_tensor_parallel does this)")


# The communicator a packed function call on this thread uses: the backend's that runs or
# captures the call. None of its own: a communicator needs the whole group.
_INSTANCES = ThreadInstances(_no_communicator)


def _packed(function: CollectiveFunction):
    """The body of packed function ``function.name``: TVM's VM passes the input, then the
    output (destination passing)."""
    import tvm  # pylint: disable=import-outside-toplevel
    import tvm_ffi  # pylint: disable=import-outside-toplevel

    def call(x: Any, out: Any) -> None:
        if out.device.dlpack_device_type() == tvm.cpu(0).dlpack_device_type():
            _on_disco(function, x, out)
            return
        stream = tvm_ffi.get_raw_stream(out.device)
        _INSTANCES.current(out.device.index).run(function, x, out, int(stream or 0))

    return call


def _on_disco(function: CollectiveFunction, x: Any, out: Any) -> None:
    """On the CPU: disco's builtin, the collective of the session this rank is a worker of."""
    import tvm  # pylint: disable=import-outside-toplevel

    builtin = tvm.get_global_func(f"runtime.disco.{function.collective}")
    if function.collective == "allreduce":
        builtin(x, tvm.runtime.ShapeTuple([_DISCO_REDUCTIONS[function.reduction]]), False, out)
    else:
        builtin(x, False, out)


def register_functions() -> None:
    """Register every ``COLLECTIVE_FUNCTIONS`` entry with TVM (idempotent)."""
    register_once(COLLECTIVE_FUNCTIONS, _packed)
