"""grape's GEMV kernels (``passes/gemv_schedule.py``) under other tilings than ``gemv_config``'s.

Two halves, one per machine:

    # the CPU machine (TVM): every tiling of each (K, N) and M, as CUDA, into one cubin
    python3 bench/gemv_configs.py build --out build/gpu/gemv_configs
    # the GPU host (torch, cuda-python): each kernel timed and checked against F.linear
    python3 bench/gemv_configs.py run --dir build/gpu/gemv_configs --out OUT

``build`` schedules ``y = x @ w^T + b`` (x: [M, K], w stored [N, K] as grape stores a
matmul's weights, fp32, M static) with ``schedule_gemv`` under ``gemv_config``'s tiling
(``default``) and under the others listed by ``candidates``: rows of M per block, threads
along K, rows of w per thread. Each kernel gets a name of its own; one nvcc call builds
them for sm_90. ``run`` launches each from the cubin: ``--reps`` calls in one CUDA graph,
timed by CUDA events, once on one weight (``warm_us``: it stays in the L2, as a small
decoder's weights do between steps) and once on copies of it filling twice the L2
(``cold_us``: read from HBM, as GPT-2's); the same for ``F.linear`` (cuBLAS, TF32 off).
Every kernel's output is checked against ``F.linear``'s. Prints the best tiling per case,
writes ``gemv_configs.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # (K, N) of y = x @ w^T: the decode-loop decoder's (hidden 256), GPT-2's
    "decoder qkv": (256, 768), "decoder out": (256, 256), "decoder up": (256, 1024),
    "decoder down": (1024, 256), "gpt2 qkv": (768, 2304), "gpt2 out": (768, 768),
    "gpt2 up": (768, 3072), "gpt2 down": (3072, 768)}
ROWS = (1, 2, 4, 8)  # M: grape's GEMV buckets for weights stored [N, K]
_SIGNATURE = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)\) (\w+)\(([^)]*)\)')


def candidates(k: int, n: int, m: int):
    """Tilings for M = m: rows of M per block, threads along K, rows of w per thread (256
    threads a block), unroll as ``gemv_config`` picks it."""
    from grape_tvm.passes.gemv_schedule import GemvConfig  # pylint: disable=import-outside-toplevel

    vec = 4
    for rows, threads_k, per_thread_n in itertools.product(
            (r for r in (1, 2, 4, 8) if r <= m), (16, 32, 64), (1, 2, 4)):
        if (k // vec) % threads_k:
            continue
        threads_n = 256 // threads_k
        if n % (threads_n * per_thread_n):
            continue
        steps = k // (threads_k * vec)
        unroll = next(u for u in (4, 3, 2, 1) if steps % u == 0)
        yield GemvConfig(rows, vec, threads_k, threads_n, per_thread_n, unroll)


def _thread_extents(func) -> dict[str, int]:
    from tvm import tirx  # pylint: disable=import-outside-toplevel
    from tvm_ffi.structural import structural_walk  # pylint: disable=import-outside-toplevel

    extents = {}

    def visit(loop):
        if loop.kind == tirx.ForKind.THREAD_BINDING:
            extents[loop.thread_binding.thread_tag] = int(loop.extent)
        return True

    structural_walk(func.body, (tirx.For, visit))
    return extents


def _kernels(label: str, k: int, n: int, m: int, cuda) -> list[dict]:
    """The CUDA of each tiling of (K, N) at M = m, with its launch, renamed uniquely."""
    import tvm  # pylint: disable=import-outside-toplevel
    from tvm import relax  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes import FuseWeightTranspose  # pylint: disable=import-outside-toplevel
    from grape_tvm.passes.gemv_schedule import (  # pylint: disable=import-outside-toplevel
        gemv_config, match_gemv, schedule_gemv)

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])), b))
        bb.emit_func_output(y)
    t = relax.transform
    with cuda:  # as grape's GPU pipeline: the transpose fused into the matmul's kernel
        mod = tvm.transform.Sequential([FuseWeightTranspose(), t.LegalizeOps(),
                                        t.AnnotateTIROpPattern(), t.FuseOps(), t.FuseTIR()])(bb.get())
    (func,) = [f for gv, f in mod.functions_items() if "matmul" in gv.name_hint]
    shape = match_gemv(func)
    default = gemv_config(shape, m)
    configs = [default] + [c for c in candidates(k, n, m) if c != default]
    out = []
    for i, config in enumerate(configs):
        scheduled = schedule_gemv(func, shape, config).mod["main"]
        source = tvm.tirx.build(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}),
                                cuda).imports[0].inspect_source()
        name = f"gemv_{k}x{n}_m{m}_{i}"
        threads, kernel, params = _SIGNATURE.search(source).groups()
        source = source.replace(kernel, name)
        extents = _thread_extents(scheduled)
        out.append({"shape": label, "k": k, "n": n, "m": m, "config": config.__dict__,
                    "default": i == 0, "kernel": name, "threads": int(threads),
                    "grid": [extents.get("blockIdx.x", 1), extents.get("blockIdx.y", 1), 1],
                    "block": [extents.get("threadIdx.x", 1), extents.get("threadIdx.y", 1), 1],
                    "params": [p.split()[-1].removesuffix("_ptr") for p in params.split(",")],
                    "source": source})
    return out


def build(out: Path) -> None:
    """Every tiling of ``SHAPES`` at each M of ``ROWS``: ``out/gemv_configs.cubin`` and
    ``gemv_configs.json`` (each kernel's name, case, tiling and launch)."""
    import tvm  # pylint: disable=import-outside-toplevel

    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    out.mkdir(parents=True, exist_ok=True)
    kernels = []
    for label, (k, n) in SHAPES.items():
        for m in ROWS:
            kernels += _kernels(label, k, n, m, cuda)
        print(f"{label}: {len(kernels)} kernels so far", flush=True)
    # One preamble (TVM's includes and helpers), then each kernel's definition (TVM's
    # sources declare their kernel before defining it).
    sources = [k.pop("source") for k in kernels]
    preamble = sources[0][:sources[0].index('extern "C" __global__')]
    bodies = [re.sub(r'extern "C" __global__ void __launch_bounds__\(\d+\) \w+\([^)]*\);\n', "",
                     s[s.index('extern "C" __global__'):]) for s in sources]
    (out / "gemv_configs.cu").write_text(preamble + "\n".join(bodies))
    subprocess.run(["nvcc", "-arch=sm_90", "-O3", "-w", "-cubin", "-o", str(out / "gemv_configs.cubin"),
                    str(out / "gemv_configs.cu")], check=True)
    (out / "gemv_configs.json").write_text(json.dumps(kernels, indent=1))
    print(f"{len(kernels)} kernels in {out / 'gemv_configs.cubin'}")


def run(directory: Path, out: Path, reps: int) -> None:
    """Time and check every kernel ``build`` made in ``directory``; results into ``out``."""
    import torch  # pylint: disable=import-outside-toplevel
    import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from runtime_kernels import write_results  # pylint: disable=import-outside-toplevel
    from torch_graph_timing import graph_us  # pylint: disable=import-outside-toplevel

    from grape_tvm.runtime.cuda_compile import kernel_params  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

    started = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.zeros(1, device="cuda")
    kernels = json.loads((directory / "gemv_configs.json").read_text())
    module = check(driver.cuModuleLoadData((directory / "gemv_configs.cubin").read_bytes()),
                   "cuModuleLoadData")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    operands = {}  # (k, n, m) -> tensors
    results = []
    for entry in kernels:
        k, n, m = entry["k"], entry["n"], entry["m"]
        if (k, n, m) not in operands:
            weight = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
            copies = max(1, -(-2 * l2 // weight.nbytes))
            operands[(k, n, m)] = {
                "x": torch.randn(m, k, device="cuda", generator=gen),
                "w": [weight] + [weight.clone() for _ in range(copies - 1)],
                "b": torch.randn(n, device="cuda", generator=gen),
                "y": torch.empty(m, n, device="cuda")}
            ops = operands[(k, n, m)]
            reference = F.linear(ops["x"], weight, ops["b"])
            ops["reference"] = reference
            cold = _rotating(lambda w, ops=ops: F.linear(ops["x"], w, ops["b"]), ops["w"])
            ops["cublas"] = {"warm_us": graph_us(lambda ops=ops: F.linear(ops["x"], ops["w"][0], ops["b"]),
                                                 reps=reps),
                             "cold_us": graph_us(cold, reps=len(ops["w"]))}
        ops = operands[(k, n, m)]
        function = check(driver.cuModuleGetFunction(module, entry["kernel"].encode()),
                         "cuModuleGetFunction")

        def launch(w, entry=entry, ops=ops, function=function):
            tensors = {"x": ops["x"], "w": w, "b": ops["b"]}
            values = [("u64", (tensors.get(p) if p in tensors else ops["y"]).data_ptr())
                      for p in entry["params"]]
            storage = kernel_params(values)
            check(driver.cuLaunchKernel(function, *entry["grid"], *entry["block"], 0,
                                        torch.cuda.current_stream().cuda_stream,
                                        ctypes.addressof(storage[1]), 0), "cuLaunchKernel")

        ops["y"].zero_()
        launch(ops["w"][0])
        torch.cuda.synchronize()
        error = float((ops["y"] - ops["reference"]).abs().max() / ops["reference"].abs().max())
        results.append({**{key: entry[key] for key in ("shape", "k", "n", "m", "config", "default",
                                                     "grid", "block")},
                        "max_rel_error": error,
                        "warm_us": graph_us(lambda launch=launch, ops=ops: launch(ops["w"][0]),
                                            reps=reps),
                        "cold_us": graph_us(_rotating(launch, ops["w"]), reps=len(ops["w"])),
                        "cublas": ops["cublas"]})
        operands_left = [e for e in kernels[kernels.index(entry) + 1:] if (e["k"], e["n"], e["m"]) == (k, n, m)]
        if not operands_left:
            operands.pop((k, n, m))
            _print_case(results, k, n, m)
    check(driver.cuModuleUnload(module), "cuModuleUnload")
    write_results(out, "gemv_configs.json", started, reps=reps,
                  what="us per call of grape's GEMV kernel (y = x @ w^T + b, fp32, w [N, K]) "
                       "under each tiling: config (rows of M per block, vec, threads_k, "
                       "threads_n, per_thread_n, unroll), default: gemv_config's; warm_us: "
                       "one weight, reps calls in one CUDA graph; cold_us: a call per copy of "
                       "the weight, copies filling twice the L2; cublas: F.linear, TF32 off; "
                       "max_rel_error: against F.linear, relative to its largest output",
                  cases=results)


def _rotating(fn, weights):
    """``fn`` on the next of ``weights`` at each call (a capture of len(weights) calls
    reads each once)."""
    position = itertools.cycle(weights)
    return lambda: fn(next(position))


def _print_case(results, k, n, m) -> None:
    case = [r for r in results if (r["k"], r["n"], r["m"]) == (k, n, m)]
    default = next(r for r in case if r["default"])
    best_warm = min(case, key=lambda r: r["warm_us"])
    best_cold = min(case, key=lambda r: r["cold_us"])
    worst_error = max(r["max_rel_error"] for r in case)

    def tiling(r):
        c = r["config"]
        return f"r{c['rows']} tk{c['threads_k']} tn{c['threads_n']} pn{c['per_thread_n']}"

    print(f"{default['shape']:>13} M={m}: warm default {default['warm_us']:.2f} "
          f"best {best_warm['warm_us']:.2f} ({tiling(best_warm)}) cublas {default['cublas']['warm_us']:.2f}"
          f" | cold default {default['cold_us']:.2f} best {best_cold['cold_us']:.2f} "
          f"({tiling(best_cold)}) cublas {default['cublas']['cold_us']:.2f} | "
          f"{len(case)} tilings, worst error {worst_error:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=Path("build/gpu/gemv_configs"))
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, default=Path("build/gpu/gemv_configs"))
    r.add_argument("--out", type=Path, default=Path("bench/results"))
    r.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if args.mode == "build":
        build(args.out)
    else:
        run(args.dir, args.out, args.reps)


if __name__ == "__main__":
    main()
