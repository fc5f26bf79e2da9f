"""What of a topology graph slows its kernels: the head node, device-updatable nodes, or the
device-side updates themselves.

    python3 bench/topology_variants.py ARTIFACT --dim NAME=VALUE [--weights W.json] --out OUT

Loads the artifact on CUDA once per variant and times queued calls at one shape (one graph
per region, so after the first launch the patch kernel has nothing to change):

- ``topology``: as grape runs it. The first launch applies every pointer (nothing is known
  to be applied yet), a device-side update per pointer parameter.
- ``primed``: the same graph, but the patch kernel's state says, before the first launch,
  that the capture's addresses are applied: no device-side update is ever made.
- ``primed_no_attr``: primed, and the kernel nodes are not made device-updatable: the head
  node alone.
- ``no_head``: device-updatable nodes, no patch node (the capture's addresses as they were).
- ``memsets_kept``: a library's memset nodes stay memset nodes (at one shape their address
  and size never change), not ``grape_fill`` kernels.
- ``per_shape``: grape's per-shape graphs, as captured.
- ``clustered_*``: cuBLASLt's algorithms as its heuristic gives them, in thread-block
  clusters where it chooses them (the runtime's ``CublasLt._without_clusters`` turned off).

``bench/results/topology_variants.b111ffc.json`` and ``topology_variants.e4b8a95.json`` were
written by this script's first form: their ``cluster1_*`` variants had the script ask for
1x1x1 clusters, where these turn the runtime's asking off.

Prints a table of microseconds per call and writes ``topology_variants.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("topology", "primed", "primed_no_attr", "no_head", "memsets_kept", "per_shape",
            "clustered_topology", "clustered_per_shape")


@contextlib.contextmanager
def variant(name: str):
    """Patch ``runtime.topology_graph`` and ``runtime.cublaslt`` for one variant, restored
    after."""
    from grape_tvm.runtime import cublaslt, cuda_backend  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime import topology_graph as tg  # pylint: disable=import-outside-toplevel

    saved = (tg.TopologyGraph.replay, tg.TopologyGraph._add_patch_node, tg.make_device_updatable)
    memsets_as_kernels = cuda_backend.memsets_as_kernels
    without_clusters = cublaslt.CublasLt._without_clusters
    if name.startswith("clustered"):
        cublaslt.CublasLt._without_clusters = lambda *args: None
    if name.startswith("primed"):
        replay = tg.TopologyGraph.replay

        def primed(self, row, region_args, stream, *args, **kwargs):
            if not getattr(self, "_primed", False):
                self._primed = True
                addresses = [a.data_ptr() if hasattr(a, "data_ptr") else 0
                             for a in region_args][:self.num_args]
                addresses += [0] * (max(self.num_args, 1) - len(addresses))
                self.buffers["applied"].write(struct.pack(f"<{len(addresses)}Q", *addresses))
                self.buffers["state"].write(struct.pack("<4I", row, 0, 0, 0))
            return replay(self, row, region_args, stream, *args, **kwargs)

        tg.TopologyGraph.replay = primed
    if name == "primed_no_attr":
        tg.make_device_updatable = lambda node: 0
    if name == "no_head":
        tg.TopologyGraph._add_patch_node = lambda self, graph: None
    if name == "memsets_kept":
        cuda_backend.memsets_as_kernels = lambda graph, memsets, fill: 0
    try:
        yield
    finally:
        tg.TopologyGraph.replay, tg.TopologyGraph._add_patch_node, tg.make_device_updatable = saved
        cublaslt.CublasLt._without_clusters = without_clusters
        cuda_backend.memsets_as_kernels = memsets_as_kernels


def cluster_sizes(executor) -> list[int]:
    """The blocks per cluster of each kernel node of the executor's graphs."""
    from grape_tvm.runtime.cuda_graph import cluster_blocks, kernel_nodes  # pylint: disable=import-outside-toplevel

    backend = executor.backend
    graphs = [g.graph for r in backend._regions.values() for g in r.graphs]  # pylint: disable=protected-access
    graphs += [g.graph for g in backend._per_shape.values()]  # pylint: disable=protected-access
    return [cluster_blocks(node) for graph in graphs for node in kernel_nodes(graph)]


def inputs_of(artifact: Path, dims: dict, weights_path: Path | None):
    import tvm  # pylint: disable=import-outside-toplevel

    from grape_tvm.loader import load_library  # pylint: disable=import-outside-toplevel
    from grape_tvm.runtime.signature import Signature  # pylint: disable=import-outside-toplevel

    _, manifest, dev = load_library(artifact, "cuda")
    signature = Signature.from_json(manifest["signature"])
    weights = {}
    if weights_path:
        from export_hf import hf_weights  # pylint: disable=import-outside-toplevel

        weights = hf_weights(weights_path)
    named = {}
    for spec in signature.inputs:
        if spec.name in weights:
            named[spec.name] = tvm.runtime.tensor(weights[spec.name], dev)
            continue
        shape = tuple(d if isinstance(d, int) else dims[d] for d in spec.shape)
        named[spec.name] = tvm.runtime.tensor(np.zeros(shape, spec.dtype), dev)
    return named, set(weights)


def time_calls(artifact: Path, named: dict, weight_names: set, graph_mode: str, calls: int,
               repeats: int) -> float:
    """Best of ``repeats`` of ``calls`` queued calls, microseconds per call."""
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    with load(artifact, "cuda", graph_mode=graph_mode) as executor:
        executor.bind_inputs({k: v for k, v in named.items() if k in weight_names})
        feeds = {k: v for k, v in named.items() if k not in executor.bound_names}
        executor.run(feeds, return_numpy=False)
        executor.backend.synchronize()
        sizes = cluster_sizes(executor)
        print(f"  kernel nodes {len(sizes)}, in clusters of more than one block "
              f"{sum(s > 1 for s in sizes)}")
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                executor.run(feeds, return_numpy=False)
            executor.backend.synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--dim", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--weights", type=Path)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    dims = {k: int(v) for k, v in (d.split("=") for d in args.dim)}
    named, weight_names = inputs_of(args.artifact, dims, args.weights)
    times = {}
    errors = {}
    for name in VARIANTS:
        mode = "per-shape" if name.endswith("per_shape") else "topology"
        try:
            with variant(name):
                times[name] = time_calls(args.artifact, named, weight_names, mode, args.calls,
                                         args.repeats)
        except Exception as error:  # pylint: disable=broad-except
            errors[name] = f"{type(error).__name__}: {error}"  # a probe: the others still run
            print(f"{args.artifact.name} {dims}: {name:16s} failed: {errors[name]}", flush=True)
            continue
        print(f"{args.artifact.name} {dims}: {name:16s} {times[name]:9.1f} us/call", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "topology_variants.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[f"{args.artifact.name} {dims}"] = {"us_per_call": times, "calls": args.calls,
                                               "repeats": args.repeats, "errors": errors}
    path.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
