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


def copy_part(source, out, axis: int, index: int, parts: int, stream) -> None:
    """Copy the ``index``-th of ``parts`` equal slices of ``source`` along ``axis`` into
    ``out``, both contiguous tensors on one device, on ``stream``: one strided copy
    (``cuMemcpy2DAsync``), a row of the slice's bytes for each index before ``axis``.
    A tensor-parallel rank's part of a whole input, taken on the device."""
    shape = tuple(int(d) for d in source.shape)
    if shape[axis] % parts:
        raise ValueError(f"axis {axis} of {shape} does not split in {parts}")
    inner = source.dtype.itemsize
    for dim in shape[axis + 1:]:
        inner *= dim
    outer = 1
    for dim in shape[:axis]:
        outer *= dim
    row = shape[axis] // parts * inner  # the slice's bytes under one index before axis
    if row == 0 or outer == 0:
        return
    if outer == 1:  # one row: a plain copy (a 2-D copy's pitch is bounded, about 2 GiB)
        check(driver.cuMemcpyDtoDAsync(out.data_ptr(), source.data_ptr() + index * row, row,
                                       stream), "cuMemcpyDtoDAsync")
        return
    copy = driver.CUDA_MEMCPY2D()
    copy.srcMemoryType = copy.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    copy.srcDevice = source.data_ptr() + index * row
    copy.srcPitch = shape[axis] * inner
    copy.dstDevice = out.data_ptr()
    copy.dstPitch = row
    copy.WidthInBytes = row
    copy.Height = outer
    check(driver.cuMemcpy2DAsync(copy, stream), "cuMemcpy2DAsync")
