"""The CUDA driver API through cuda-python, and one way to check its results."""

from __future__ import annotations

try:
    from cuda.bindings import driver
except ImportError:  # cuda-python < 12.6 spells it cuda.cuda
    try:
        from cuda import cuda as driver  # type: ignore[no-redef]
    except ImportError:
        driver = None  # type: ignore[assignment]


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


SUCCESS = driver.CUresult.CUDA_SUCCESS if driver is not None else None


def check(result, what: str):
    """Unwrap a cuda-python ``(err, *values)`` tuple; raise ``CudaError`` naming the call.

    Per-shape graphs launch through here (``CapturedGraph``): success is decided by one
    comparison, and nothing is unpacked into a new list."""
    if driver is None:
        raise CudaError(f"{what}: cuda-python is not installed (pip install cuda-python)")
    err = result[0] if type(result) is tuple else result
    if err != SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err}")
    if type(result) is not tuple or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]
