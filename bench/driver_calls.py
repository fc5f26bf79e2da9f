"""Benchmark: the host cost of the two driver calls a planned call makes, by binding.

A replay is a ``cuMemcpyHtoDAsync`` of the launch record (when it changed) and a
``cuGraphLaunch``. grape calls them through cuda-python; this measures each through
cuda-python and through ctypes on ``libcuda`` directly, on a one-node graph (a memset), in
one process, so that the binding's share of the host path is known. Also what could replace
the copy when few words of the record change (a new row and one moved address, as when n
changes on every call): the copy of a small record, from pageable and from pinned memory,
and stream memory operations writing the words themselves (``cuStreamWriteValue*``, or two
writes in one ``cuStreamBatchMemOp``). And a kernel node's parameters set in the
instantiated graph (``cuGraphExecKernelNodeSetParams``), which is how a call made again
points the patch node at its launch record kept on the device.

    python3 bench/driver_calls.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

CALLS = 20000


def _time(call, calls: int, sync) -> float:
    """Median over 5 rounds of the microseconds per call; the stream synced every 256."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(calls):
            call()
            if i % 256 == 255:
                sync()
        rounds.append((time.perf_counter() - t0) * 1e6 / calls)
        sync()
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    from cuda.bindings import driver  # pylint: disable=import-outside-toplevel

    def check(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA error {err}")
        return rest[0] if len(rest) == 1 else rest

    check(driver.cuInit(0))
    device = check(driver.cuDeviceGet(0))
    context = check(driver.cuDevicePrimaryCtxRetain(device))
    check(driver.cuCtxSetCurrent(context))
    stream = check(driver.cuStreamCreate(0))
    buffer = check(driver.cuMemAlloc(1 << 20))
    graph = check(driver.cuGraphCreate(0))
    memset = driver.CUDA_MEMSET_NODE_PARAMS()
    memset.dst, memset.value, memset.elementSize, memset.width, memset.height = buffer, 0, 1, 256, 1
    check(driver.cuGraphAddMemsetNode(graph, None, 0, memset, context))
    exec_ = check(driver.cuGraphInstantiate(graph, 0))
    record = bytes(2400)  # GPT-2 decode's launch record: 624 arguments and a row
    libcuda = ctypes.CDLL("libcuda.so.1")
    libcuda.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    libcuda.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_void_p]
    raw_exec, raw_stream, raw_dst = int(exec_), int(stream), int(buffer)
    host = ctypes.create_string_buffer(record, len(record))

    def sync():
        check(driver.cuStreamSynchronize(stream))

    result = {
        "machine": "see run.log (nvidia-smi)", "command": "python3 bench/driver_calls.py",
        "calls": CALLS, "record_bytes": len(record),
        "us_per_call": {
            "cuGraphLaunch cuda-python": _time(lambda: check(driver.cuGraphLaunch(exec_, stream)),
                                               CALLS, sync),
            "cuGraphLaunch ctypes": _time(lambda: libcuda.cuGraphLaunch(raw_exec, raw_stream),
                                          CALLS, sync),
            "cuMemcpyHtoDAsync cuda-python (bytes)": _time(
                lambda: check(driver.cuMemcpyHtoDAsync(buffer, record, len(record), stream)),
                CALLS, sync),
            "cuMemcpyHtoDAsync ctypes": _time(
                lambda: libcuda.cuMemcpyHtoDAsync_v2(raw_dst, host, len(record), raw_stream),
                CALLS, sync),
        },
    }
    result["us_per_call"].update(_small_writes(driver, check, libcuda, stream, buffer, sync))
    result["us_per_call"].update(_node_param_updates(driver, check, stream, buffer, sync))
    for name, us in result["us_per_call"].items():
        print(f"  {name:40s} {us:6.2f} us")
    driver.cuGraphExecDestroy(exec_)
    driver.cuGraphDestroy(graph)
    driver.cuMemFree(buffer)
    driver.cuStreamDestroy(stream)
    driver.cuDevicePrimaryCtxRelease(device)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "driver_calls.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'driver_calls.json'}", file=sys.stderr)


def _small_writes(driver, check, libcuda, stream, buffer, sync) -> dict[str, float]:
    """A row (4 bytes) and an address (8 bytes) into the device buffer, each way; a way the
    driver here does not offer is left out (printed)."""
    small = bytes(16)
    pinned = check(driver.cuMemHostAlloc(len(small), 0))
    raw_stream, raw_dst = int(stream), int(buffer)
    out = {}
    ways = {
        "cuMemcpyHtoDAsync cuda-python (16 bytes)": lambda: check(
            driver.cuMemcpyHtoDAsync(buffer, small, len(small), stream)),
        "cuMemcpyHtoDAsync cuda-python (16 bytes, pinned)": lambda: check(
            driver.cuMemcpyHtoDAsync(buffer, pinned, len(small), stream)),
        "cuStreamWriteValue32 + cuStreamWriteValue64 cuda-python": lambda: (
            check(driver.cuStreamWriteValue32(stream, buffer, 7, 0)),
            check(driver.cuStreamWriteValue64(stream, int(buffer) + 8, 1 << 40, 0))),
    }
    try:
        batch = libcuda.cuStreamBatchMemOp_v2
        batch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
        ops = (ctypes.c_uint64 * 12)()  # two CUstreamBatchMemOpParams of 48 bytes
        write32, write64 = 2, 5  # CU_STREAM_MEM_OP_WRITE_VALUE_32 / _64
        ops[0], ops[1], ops[2] = write32, raw_dst, 7
        ops[6], ops[7], ops[8] = write64, raw_dst + 8, 1 << 40
        ways["cuStreamBatchMemOp ctypes (2 writes)"] = lambda: batch(raw_stream, 2, ops, 0)
    except AttributeError:
        print("  cuStreamBatchMemOp_v2: not in this libcuda")
    for name, call in ways.items():
        try:
            status = call()
            sync()
        except Exception as error:  # pylint: disable=broad-except
            print(f"  {name}: {error}")
            continue
        if isinstance(status, int) and status != 0:  # a ctypes call's CUresult
            print(f"  {name}: CUresult {status}")
            continue
        out[name] = _time(call, CALLS, sync)
    check(driver.cuMemFreeHost(pinned))
    return out


def _node_param_updates(driver, check, stream, buffer, sync) -> dict[str, float]:
    """A kernel node's parameters set in the instantiated graph from the host (a record's
    address could be passed so, instead of copying the record), alternating between two
    prepared sets, with and without the launch after it: ``grape_fill`` writing 16 bytes,
    the one node of its graph."""
    from grape_tvm.runtime.cuda_compile import CubinStore, kernel_params  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.topology_graph import PatchKernel, kernel_node_params  # pylint: disable=import-outside-toplevel

    device = check(driver.cuCtxGetDevice())
    major = check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device))
    minor = check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))
    kernel = PatchKernel(CubinStore(f"sm_{major}{minor}"))
    storages = [kernel_params([("u64", int(buffer)), ("u64", 16), ("u64", 16), ("u64", 1),
                               ("u32", value), ("u32", 1)]) for value in (1, 2)]
    params = [kernel_node_params(kernel.fill, 1, 256, 0, storage) for storage in storages]
    graph = check(driver.cuGraphCreate(0))
    node = check(driver.cuGraphAddKernelNode(graph, None, 0, params[0]))
    exec_ = check(driver.cuGraphInstantiate(graph, 0))
    turn = [0]

    def set_params():
        turn[0] ^= 1
        check(driver.cuGraphExecKernelNodeSetParams(exec_, node, params[turn[0]]))

    def set_and_launch():
        set_params()
        check(driver.cuGraphLaunch(exec_, stream))

    out = {"cuGraphExecKernelNodeSetParams cuda-python": _time(set_params, CALLS, sync),
           "cuGraphExecKernelNodeSetParams + cuGraphLaunch cuda-python":
               _time(set_and_launch, CALLS, sync)}
    driver.cuGraphExecDestroy(exec_)
    driver.cuGraphDestroy(graph)
    kernel.close()
    return out


if __name__ == "__main__":
    main()
