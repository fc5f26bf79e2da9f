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


def check(result, what: str):
    """Unwrap a cuda-python ``(err, *values)`` tuple; raise ``CudaError`` naming the call."""
    if driver is None:
        raise CudaError(f"{what}: cuda-python is not installed (pip install cuda-python)")
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if name else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
