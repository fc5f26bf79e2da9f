"""Probe: cuBLASLt matmuls captured into a CUDA graph, re-pointed and re-shaped from the device.

What grape's argument tables need to know before library matmuls can join its graphs
(issue "Matmuls at vendor speed inside the graphs"), measured, not assumed, on the GPU host:

1. cuBLASLt's heuristic for the GPT-2 layer shapes: which kernels, how many distinct ones
   over M = 1..1024 (the buckets an algorithm choice must cover).
2. A cublasLtMatmul captured with stream capture: its graph nodes, where each kernel keeps
   its parameters (``kernelParams`` or ``extra``), whether ``cuFuncGetParamInfo`` describes
   them, where the operands' addresses appear in the parameter bytes.
3. Whether those nodes take the device-updatable attribute, and whether a kernel in the same
   graph can re-point them (``cudaGraphKernelNodeSetParam`` on every occurrence of an
   operand's address: a new input) and re-shape them (the bytes and grid that differ
   between captures at M and M' with one algorithm: a new shape), checked against torch.

    python3 bench/probe_cublaslt.py --out OUT_DIR     # needs torch, cuda-python, nvcc, a GPU

Nothing here is used by grape's runtime; it decides how that runtime is written.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)]
WORKSPACE = 32 << 20
CUDA_R_32F, CUDA_R_16F = 0, 2
COMPUTE_32F = 68
OP_N = 0
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE = 1
ALGO_CONFIG_ID = 0

SETTER_SOURCE = r"""
#include <cuda_runtime.h>
struct Patch { unsigned int offset, size; unsigned char bytes[16]; };
// Applies `count` parameter patches and, when gx != 0, a grid to one device-updatable node.
extern "C" __global__ void grape_probe_set(cudaGraphDeviceNode_t node, const Patch* patches,
                                           unsigned int count, unsigned int gx,
                                           unsigned int gy, unsigned int gz) {
  if (threadIdx.x != 0) return;
  for (unsigned int i = 0; i < count; ++i)
    cudaGraphKernelNodeSetParam(node, patches[i].offset, patches[i].bytes, patches[i].size);
  if (gx != 0) cudaGraphKernelNodeSetGridDim(node, dim3(gx, gy, gz));
}
"""


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


class Patch(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint32), ("size", ctypes.c_uint32),
                ("bytes", ctypes.c_uint8 * 16)]


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} returned cublasStatus {status}")


class Lt:
    """The few cuBLASLt calls the probe makes, through ctypes."""

    def __init__(self):
        self.lib = None
        for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
            try:
                self.lib = ctypes.CDLL(name)
                self.name = name
                break
            except OSError:
                continue
        if self.lib is None:
            raise RuntimeError("libcublasLt not found")
        self.handle = ctypes.c_void_p()
        _ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(self.lib.cublasLtGetVersion())

    def matmul_plan(self, m: int, k: int, n: int, dtype: int):
        """Row-major (m, k) @ (k, n) as column-major (n, k) @ (k, m): descriptors."""
        lib = self.lib
        desc = ctypes.c_void_p()
        _ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F), "DescCreate")
        op = ctypes.c_int32(OP_N)
        for attr in (DESC_TRANSA, DESC_TRANSB):
            _ok(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(op),
                                                   ctypes.c_size_t(4)), "DescSet")
        layouts = []
        for rows, cols in ((n, k), (k, m), (n, m)):
            layout = ctypes.c_void_p()
            _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, ctypes.c_uint64(rows),
                                               ctypes.c_uint64(cols), ctypes.c_int64(rows)),
                "LayoutCreate")
            layouts.append(layout)
        return desc, layouts

    def heuristics(self, desc, layouts, count: int = 8) -> list[Heuristic]:
        lib = self.lib
        pref = ctypes.c_void_p()
        _ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PrefCreate")
        size = ctypes.c_uint64(WORKSPACE)
        _ok(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size),
                                                     ctypes.c_size_t(8)), "PrefSet")
        results = (Heuristic * count)()
        found = ctypes.c_int()
        a, b, c = layouts
        _ok(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, count, results,
                                                ctypes.byref(found)), "AlgoGetHeuristic")
        return list(results[:found.value])

    def algo_id(self, heuristic: Heuristic) -> int:
        value, written = ctypes.c_int32(), ctypes.c_size_t()
        _ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(heuristic.algo), ALGO_CONFIG_ID, ctypes.byref(value),
            ctypes.c_size_t(4), ctypes.byref(written)), "AlgoConfigGet")
        return value.value

    def matmul(self, desc, layouts, heuristic, x, w, out, workspace, stream: int) -> None:
        """out = x @ w (torch tensors, row major) on ``stream``."""
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a, b, c = layouts
        self.lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 16
        _ok(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.addressof(alpha), w.data_ptr(), a, x.data_ptr(), b,
            ctypes.addressof(beta), out.data_ptr(), c, out.data_ptr(), c,
            ctypes.addressof(heuristic.algo), workspace.data_ptr(), WORKSPACE, stream), "Matmul")


def heuristic_survey(lt: Lt, torch) -> dict:
    """Distinct algorithms cuBLASLt's first choice takes over M = 1..1024, per (K, N)."""
    survey = {}
    for dtype, name in ((CUDA_R_32F, "float32"), (CUDA_R_16F, "float16")):
        for k, n in SHAPES:
            ids = []
            for m in range(1, 1025):
                desc, layouts = lt.matmul_plan(m, k, n, dtype)
                found = lt.heuristics(desc, layouts, 1)
                ids.append(lt.algo_id(found[0]) if found else -1)
            survey[f"{name}/{k}x{n}"] = {"distinct_first_choices": len(set(ids)),
                                         "changes_at_m": [m + 1 for m in range(1, 1024)
                                                          if ids[m] != ids[m - 1]][:64]}
    return survey


def _driver():
    from cuda.bindings import driver  # pylint: disable=import-outside-toplevel

    def check(result, what):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return values[0] if len(values) == 1 else tuple(values) if values else None

    return driver, check


def capture(lt: Lt, torch, desc, layouts, heuristic, x, w, out, workspace):
    """A graph holding one cublasLtMatmul, captured on a side stream."""
    driver, check = _driver()
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    check(driver.cuStreamBeginCapture(stream.cuda_stream,
                                      driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
          "cuStreamBeginCapture")
    try:
        lt.matmul(desc, layouts, heuristic, x, w, out, workspace, stream.cuda_stream)
    finally:
        graph = check(driver.cuStreamEndCapture(stream.cuda_stream), "cuStreamEndCapture")
    return graph


def kernel_nodes(graph) -> list[dict]:
    """Every node of ``graph``: its type and, for kernels, name, grid, parameter bytes."""
    driver, check = _driver()
    _, count = check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    found = []
    for node in nodes[:count]:
        kind = check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        entry = {"node": node, "type": str(kind).rsplit(".", 1)[-1]}
        if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            params = check(driver.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            entry.update(_kernel_entry(params))
        found.append(entry)
    return found


def _kernel_entry(params) -> dict:
    driver, _ = _driver()
    err, name = driver.cuFuncGetName(params.func)
    layout = []
    while True:
        err_info, offset, size = driver.cuFuncGetParamInfo(params.func, len(layout))
        if err_info != driver.CUresult.CUDA_SUCCESS:
            break
        layout.append((int(offset), int(size)))
    entry = {"name": name.decode() if err == driver.CUresult.CUDA_SUCCESS and name else "?",
             "grid": (params.gridDimX, params.gridDimY, params.gridDimZ),
             "block": (params.blockDimX, params.blockDimY, params.blockDimZ),
             "shared": params.sharedMemBytes, "param_info": layout,
             "kernelParams_null": int(params.kernelParams or 0) == 0,
             "extra_null": int(params.extra or 0) == 0, "func": params.func}
    entry["bytes"] = _param_bytes(params, layout)
    return entry


def _param_bytes(params, layout) -> bytes:
    """The kernel's parameter buffer as it will be passed: from ``extra`` (one buffer) or
    from ``kernelParams`` laid out by ``cuFuncGetParamInfo``."""
    extra = int(params.extra or 0)
    if extra:
        entries = (ctypes.c_void_p * 6).from_address(extra)
        buffer = size = None
        for i in range(0, 6, 2):
            key = entries[i] or 0
            if key == 1:  # CU_LAUNCH_PARAM_BUFFER_POINTER
                buffer = entries[i + 1]
            elif key == 2:  # CU_LAUNCH_PARAM_BUFFER_SIZE
                size = ctypes.c_size_t.from_address(entries[i + 1]).value
            elif key == 0:
                break
        return ctypes.string_at(buffer, size) if buffer and size else b""
    base = int(params.kernelParams or 0)
    if not base or not layout:
        return b""
    total = max(o + s for o, s in layout)
    raw = bytearray(total)
    for i, (offset, size) in enumerate(layout):
        addr = ctypes.c_void_p.from_address(base + 8 * i).value
        raw[offset:offset + size] = ctypes.string_at(addr, size)
    return bytes(raw)


def occurrences(data: bytes, address: int) -> list[int]:
    needle = address.to_bytes(8, "little")
    found, start = [], 0
    while True:
        i = data.find(needle, start)
        if i < 0:
            return found
        found.append(i)
        start = i + 1


def compile_setter(arch: str = "sm_90"):
    driver, check = _driver()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "set.cu"), Path(tmp, "set.cubin")
        src.write_text(SETTER_SOURCE)
        subprocess.run(["nvcc", "--cubin", f"-arch={arch}", "-o", str(out), str(src)], check=True)
        module = check(driver.cuModuleLoadData(out.read_bytes()), "cuModuleLoadData")
    return check(driver.cuModuleGetFunction(module, b"grape_probe_set"), "cuModuleGetFunction")


def device_updatable(node) -> int:
    driver, check = _driver()
    attr = driver.CUkernelNodeAttrID.CU_LAUNCH_ATTRIBUTE_DEVICE_UPDATABLE_KERNEL_NODE
    value = driver.CUkernelNodeAttrValue()
    value.deviceUpdatableKernelNode.deviceUpdatable = 1
    check(driver.cuGraphKernelNodeSetAttribute(node, attr, value), "SetAttribute(updatable)")
    got = check(driver.cuGraphKernelNodeGetAttribute(node, attr), "GetAttribute")
    return int(got.deviceUpdatableKernelNode.devNode)


def patches_between(before: bytes, after: bytes) -> list[tuple[int, bytes]]:
    """Runs of differing bytes, cut into pieces of at most 16 bytes at 8-byte alignment."""
    runs, i = [], 0
    while i < len(after):
        if i < len(before) and before[i] == after[i]:
            i += 1
            continue
        start = i - i % 8
        end = min(start + 16, len(after))
        runs.append((start, after[start:end]))
        i = end
    return runs


def repoint_and_reshape(lt: Lt, torch, dtype: int, torch_dtype, k: int, n: int, m: int,
                        m_new: int, setter) -> dict:
    """Capture at (m, k, n); then, from a kernel in the same graph, give its cuBLAS nodes a
    new input (every occurrence of x's address) and the bytes and grid of a capture at
    m_new with the same algorithm; launch; compare with torch."""
    driver, check = _driver()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(k, n, device="cuda", dtype=torch_dtype, generator=gen) / k ** 0.5
    x = torch.randn(m, k, device="cuda", dtype=torch_dtype, generator=gen)
    x_new = torch.randn(m, k, device="cuda", dtype=torch_dtype, generator=gen)
    out = torch.empty(m, n, device="cuda", dtype=torch_dtype)
    workspace = torch.empty(WORKSPACE, device="cuda", dtype=torch.uint8)
    desc, layouts = lt.matmul_plan(m, k, n, dtype)
    heuristic = lt.heuristics(desc, layouts, 1)[0]
    graph = capture(lt, torch, desc, layouts, heuristic, x, w, out, workspace)
    nodes = kernel_nodes(graph)
    kernels = [e for e in nodes if "name" in e]
    # The same algorithm at m_new, on the new input: the bytes the table would carry.
    desc2, layouts2 = lt.matmul_plan(m_new, k, n, dtype)
    graph2 = capture(lt, torch, desc2, layouts2, heuristic, x_new[:m_new], w, out, workspace)
    kernels2 = [e for e in kernel_nodes(graph2) if "name" in e]
    report = {
        "nodes": [{key: e[key] for key in ("type", "name", "grid", "block", "shared",
                                           "kernelParams_null", "extra_null", "param_info")
                   if key in e} for e in nodes],
        "param_bytes": [len(e["bytes"]) for e in kernels],
        "x_address_at": [occurrences(e["bytes"], x.data_ptr()) for e in kernels],
        "w_address_at": [occurrences(e["bytes"], w.data_ptr()) for e in kernels],
        "out_address_at": [occurrences(e["bytes"], out.data_ptr()) for e in kernels],
        "same_kernels_at_m_new": [e["name"] for e in kernels] == [e["name"] for e in kernels2],
        "bytes_differing_at_m_new": [sum(a != b for a, b in zip(e["bytes"], f["bytes"]))
                                     for e, f in zip(kernels, kernels2)],
    }
    if not report["same_kernels_at_m_new"]:
        report["result"] = "the algorithm runs other kernels at m_new: no shared topology"
        return report
    # Device-updatable nodes, and a setter node per kernel ahead of them.
    dev_nodes = [device_updatable(e["node"]) for e in kernels]
    keep = []
    roots, count = check(driver.cuGraphGetRootNodes(graph, 0), "roots")
    roots, count = check(driver.cuGraphGetRootNodes(graph, count), "roots")
    roots = list(roots[:count])
    for dev_node, e, f in zip(dev_nodes, kernels, kernels2):
        patch_list = patches_between(e["bytes"], f["bytes"])
        table = (Patch * max(len(patch_list), 1))()
        for i, (offset, data) in enumerate(patch_list):
            table[i].offset, table[i].size = offset, len(data)
            ctypes.memmove(table[i].bytes, data, len(data))
        device_table = torch.empty(ctypes.sizeof(table), device="cuda", dtype=torch.uint8)
        check(driver.cuMemcpyHtoD(device_table.data_ptr(), table, ctypes.sizeof(table)), "HtoD")
        grid = f["grid"] if f["grid"] != e["grid"] else (0, 0, 0)
        boxes = [ctypes.c_uint64(dev_node), ctypes.c_uint64(device_table.data_ptr()),
                 ctypes.c_uint32(len(patch_list)), *(ctypes.c_uint32(g) for g in grid)]
        pointers = (ctypes.c_void_p * len(boxes))(*[ctypes.addressof(b) for b in boxes])
        params = driver.CUDA_KERNEL_NODE_PARAMS()
        params.func = setter
        params.gridDimX = params.gridDimY = params.gridDimZ = 1
        params.blockDimX, params.blockDimY, params.blockDimZ = 32, 1, 1
        params.sharedMemBytes = 0
        params.kernelParams = ctypes.addressof(pointers)
        node = check(driver.cuGraphAddKernelNode(graph, None, 0, params), "AddKernelNode")
        check(driver.cuGraphAddDependencies(graph, [node] * len(roots), roots, None, len(roots)),
              "AddDependencies")
        keep += [boxes, pointers, device_table, table]
        report.setdefault("patches", []).append(len(patch_list))
    exe = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    stream = torch.cuda.Stream()
    check(driver.cuGraphUpload(exe, stream.cuda_stream), "cuGraphUpload")
    out.fill_(float("nan"))
    check(driver.cuGraphLaunch(exe, stream.cuda_stream), "cuGraphLaunch")
    stream.synchronize()
    want = (x_new[:m_new].float() @ w.float())
    got = out[:m_new].float()
    error = float(((got - want).norm() / want.norm()).item())
    report.update(relative_error=error, finite=bool(torch.isfinite(got).all().item()),
                  result="re-pointed and re-shaped from the device: correct"
                  if error < (1e-5 if dtype == CUDA_R_32F else 1e-2) else
                  "re-pointed and re-shaped from the device: WRONG")
    check(driver.cuGraphExecDestroy(exe), "destroy")
    del keep
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    import torch  # pylint: disable=import-outside-toplevel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # loads cuBLAS(Lt)
    lt = Lt()
    result = {"machine": torch.cuda.get_device_name(0), "command": "python3 " + " ".join(sys.argv),
              "cublaslt": {"library": lt.name, "version": lt.version}}
    for name, step in (("heuristics", lambda: heuristic_survey(lt, torch)),
                       ("setter", compile_setter)):
        try:
            result[name] = step()
        except Exception:  # pylint: disable=broad-except
            result[name] = {"error": traceback.format_exc()[-2000:]}
    setter = result.pop("setter")
    cases = {}
    for dtype, torch_dtype, label in ((CUDA_R_32F, torch.float32, "float32"),
                                      (CUDA_R_16F, torch.float16, "float16")):
        for (k, n), (m, m_new) in (((768, 3072), (64, 63)), ((768, 3072), (1, 1)),
                                   ((3072, 768), (300, 301)), ((768, 50257), (8, 5))):
            key = f"{label}/{m}->{m_new}x{k}x{n}"
            try:
                if isinstance(setter, dict):
                    raise RuntimeError(f"no setter kernel: {setter['error'][-300:]}")
                cases[key] = repoint_and_reshape(lt, torch, dtype, torch_dtype, k, n, m, m_new,
                                                 setter)
            except Exception:  # pylint: disable=broad-except
                cases[key] = {"error": traceback.format_exc()[-2000:]}
            print(key, cases[key].get("result", cases[key].get("error", "")[-300:]), flush=True)
    result["capture"] = cases
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_cublaslt.json").write_text(json.dumps(result, indent=1, default=str))
    for key, value in result.get("heuristics", {}).items():
        if isinstance(value, dict) and "distinct_first_choices" in value:
            print(f"{key}: {value['distinct_first_choices']} distinct first choices over M=1..1024")


if __name__ == "__main__":
    main()
