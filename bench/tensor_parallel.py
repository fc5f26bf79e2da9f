"""Benchmark: tensor parallelism, 2 GPUs against 1 (issue 16).

Models (``models.TENSOR_PARALLEL_MODELS``, built on the CPU machine by
``bench/gpu/build_artifacts.py``, one artifact for one GPU and one for two):
``llama_7b``, a Llama decode step at Llama-2-7B's sizes in fp16, batch 1..8; ``gpt2``,
GPT-2's sizes in fp32 at batch 1, where the all-reduces weigh more than the split saves.
Weights are random, made on GPU 0 by torch from a seed (never carried): the one-GPU
executor reads them in place; the two-GPU session takes them whole, a layer at a time
through the host (each rank keeps its part), so the host holds about one layer's weights
at once (7B: ~0.4 GB, a few copies of it in flight), not the model's 13.5 GB.

Measured, in one run, one GPU beside two:

- a teacher-forced decode of 128 steps from a random one-token cache (batch 1; the same
  tokens, embeddings and caches on both): ``max_logit_diff``, the largest difference of
  the two GPUs' logits from one GPU's, relative to one GPU's largest magnitude, worst over
  the steps; ``tokens_identical_where_decided``, the greedy tokens equal wherever one GPU's
  top two logits differ by more than that tolerance (``TOLERANCE``). GPT-2's step has no LM
  head: its output ``y`` (the final hidden state) is compared, and there are no tokens.
- the decode step (a call with inputs on the host, the logits back on the host; the caches
  stay on the devices, fed back), median of ``--reps`` consecutive steps from a cache of
  each length in ``--pasts``, at batch 1 and 8 (GPT-2: 1); the ratio 2 GPUs / 1 GPU.
- graph memory per rank (``CudaGraphBackend.graph_device_bytes``, read on each rank), with
  one graph per topology after every cache length of the declared range at batch 1, and
  with one graph per shape: bytes per graph over the first ``--per-shape-sample`` lengths,
  times the lengths of the range (per-shape graphs barely differ in size by length).

    python3 bench/tensor_parallel.py --artifacts build/gpu --out OUT_DIR [--quick]

Needs two visible GPUs: with fewer it says so on one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from models import (GPT2_BENCH, LLAMA_7B, TENSOR_PARALLEL_MODELS,  # noqa: E402  pylint: disable=wrong-import-position
                    gpt2_output_names, gpt2_qkv_by_ranks, gpt2_shapes, llama_cache_names,
                    llama_output_names, llama_rotary, llama_shapes, llama_weight_init,
                    tensor_parallel_artifact)

TOLERANCE = 2e-2  # of the largest logit's magnitude: the bound on the difference
DECODE_STEPS = 128
SEED = 0


class Model:
    """One benchmark model: its inputs, its weights made on GPU 0, and how a step's inputs
    and outputs are named."""

    def __init__(self, name: str, torch):
        self.name, self.torch = name, torch
        self.dtype = TENSOR_PARALLEL_MODELS[name]["dtype"]
        self.dims = TENSOR_PARALLEL_MODELS[name]["dims"]
        self.llama = name != "gpt2"
        if self.llama:
            self.hidden, self.heads, layers = LLAMA_7B.hidden, LLAMA_7B.heads, LLAMA_7B.layers
            self.shapes = llama_shapes(LLAMA_7B)
            self.outputs = llama_output_names(layers)
        else:
            self.hidden, self.heads, layers = (GPT2_BENCH[k] for k in ("hidden", "heads", "layers"))
            self.shapes = gpt2_shapes(self.hidden, layers)
            self.outputs = gpt2_output_names(layers)
        self.caches = llama_cache_names(layers)  # past_k0, past_v0, ...: both models' names
        self.keep = {f"present_{c[5:]}": c for c in self.caches}
        self.head_dim = self.hidden // self.heads
        self.batches = (1, 8) if "batch" in self.dims else (1,)
        self.past_max = self.dims["past"][1]
        self.torch_dtype = getattr(torch, self.dtype)

    def weights(self) -> dict:
        """Every weight on GPU 0, from ``SEED``: norms near 1, products at std 0.02 (GPT-2's
        biases too), drawn in parameter order by one generator."""
        torch = self.torch
        gen = torch.Generator(device="cuda:0").manual_seed(SEED)
        out = {}
        for name, shape in self.shapes.items():
            if self.llama:
                mean, std = llama_weight_init(name)
            else:
                mean, std = (1.0, 0.1) if name.rstrip("0123456789").endswith("_g") else (0.0, 0.02)
            value = torch.randn(shape, generator=gen, device="cuda:0", dtype=torch.float32)
            out[name] = (value * std + mean).to(self.torch_dtype)
        return out

    def layer_chunks(self, weights: dict) -> list[list[str]]:
        """The weights' names a layer at a time (the rest last): what is on the host at once
        when binding the two-GPU session."""
        chunks: dict[str, list[str]] = {}
        for name in weights:
            digits = name[len(name.rstrip("0123456789")):]
            chunks.setdefault(digits, []).append(name)
        return list(chunks.values())

    def cache_shape(self, batch: int, length: int) -> tuple[int, ...]:
        per_batch = (self.heads, length, self.head_dim)
        return (batch, *per_batch) if self.llama else per_batch

    def step_inputs(self, x: np.ndarray, position: int) -> dict[str, np.ndarray]:
        """A step's inputs besides the caches: the token's embedding and, for Llama, the
        rotary tables of its position (each sequence at the same one)."""
        if not self.llama:
            return {"x": x}
        cos, sin = llama_rotary(LLAMA_7B, [position] * x.shape[0], self.dtype)
        return {"x": x, "cos": cos, "sin": sin}

    @property
    def compared(self) -> str:
        return "logits" if self.llama else "y"


class Pair:
    """The model on one GPU (grape's executor, GPU 0) and on two (a tensor-parallel session
    on GPUs 0 and 1), its weights bound to both."""

    def __init__(self, model: Model, artifacts: Path, graph_mode: str = "topology"):
        from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel
        from grape_tvm.tensor_parallel_session import TensorParallelSession  # pylint: disable=import-outside-toplevel
        import tvm  # pylint: disable=import-outside-toplevel

        self.model, self.tvm = model, tvm
        torch = model.torch
        self.weights = model.weights()  # on GPU 0: the one-GPU executor reads them in place
        self.one = load(artifacts / tensor_parallel_artifact(model.name, 1), "cuda:0",
                        graph_mode=graph_mode)
        self.one.bind_inputs({k: tvm.runtime.from_dlpack(v) for k, v in self.weights.items()})
        self.two = TensorParallelSession(artifacts / tensor_parallel_artifact(model.name, 2),
                                         [0, 1], graph_mode=graph_mode)
        started = time.perf_counter()
        for names in model.layer_chunks(self.weights):
            chunk = {k: self.weights[k].cpu().numpy() for k in names}
            if not model.llama:  # each rank's q, k, v columns together
                chunk = gpt2_qkv_by_ranks(chunk, model.heads, 2)
            self.two.bind_inputs(chunk)
        torch.cuda.synchronize()
        print(f"  {model.name}: weights bound to the two GPUs in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        self._one_caches: dict = {}  # the one-GPU executor's caches, fed back

    def embeddings(self, tokens: np.ndarray) -> np.ndarray:
        """The tokens' embeddings (host): rows of a seeded table, scaled as a model's."""
        gen = np.random.default_rng([SEED, *np.asarray(tokens).ravel().tolist()])
        return (0.02 * gen.standard_normal((len(tokens), self.model.hidden))).astype(self.model.dtype)

    def start(self, batch: int, length: int, seed: int) -> dict[str, np.ndarray]:
        """Random caches of ``length`` tokens (host), for both to start from."""
        rng = np.random.default_rng(seed)
        shape = self.model.cache_shape(batch, length)
        return {c: rng.standard_normal(shape).astype(self.model.dtype) for c in self.model.caches}

    def step_one(self, inputs: dict, caches: dict | None) -> np.ndarray:
        """A step on one GPU; ``caches`` to start from, else the last step's presents."""
        if caches is not None:
            self._one_caches = caches
        outputs = self.one.run({**inputs, **self._one_caches}, return_numpy=False)
        self._one_caches = {c: outputs[p] for p, c in self.model.keep.items()}
        return outputs[self.model.compared].numpy()

    def step_two(self, inputs: dict, caches: dict | None) -> np.ndarray:
        got = self.two.run({**inputs, **(caches or {})}, feed_back=self.model.keep)
        return got[self.model.compared]

    def reset(self) -> None:
        """Drop the caches both sides keep between steps: the next step starts from its own."""
        self.two.drop_kept()
        self._one_caches = {}

    def rank_graph_memory(self) -> list[dict]:
        """What each rank's CUDA backend holds in graphs."""
        keys = ("mode", "graph_device_bytes", "graphs_captured", "graphs_instantiated",
                "per_shape_graphs", "evicted")
        return [{k: rank.get(k) for k in keys} for rank in self.two.describe()]

    def close(self) -> None:
        self.two.close()
        self.one.close()
        self.weights = {}


def compare_decode(pair: Pair, steps: int) -> dict:
    """A teacher-forced decode of ``steps`` steps at batch 1 from a random one-token cache,
    on one GPU and on two: the worst relative difference of their outputs, and for Llama
    whether the greedy tokens agree wherever one GPU's top two differ by more than the
    tolerance."""
    model = pair.model
    tokens = np.random.default_rng(SEED + 1).integers(0, 32000, size=steps)
    caches = pair.start(1, 1, seed=SEED + 2)
    worst, decided, agreeing = 0.0, 0, 0
    for step, token in enumerate(tokens):
        inputs = model.step_inputs(pair.embeddings(np.array([token])), position=1 + step)
        first = caches if step == 0 else None
        one = pair.step_one(inputs, first).astype(np.float64)
        two = pair.step_two(inputs, first).astype(np.float64)
        scale = max(float(np.abs(one).max()), 1e-30)
        worst = max(worst, float(np.abs(two - one).max()) / scale)
        if model.llama:
            for row_one, row_two in zip(one, two):
                top2 = np.sort(row_one)[-2:]
                if top2[1] - top2[0] > TOLERANCE * scale:
                    decided += 1
                    agreeing += int(np.argmax(row_two) == np.argmax(row_one))
    pair.reset()
    out = {"max_logit_diff": worst, "compared_output": model.compared, "steps": steps}
    if model.llama:
        out.update(tokens_identical_where_decided=decided == agreeing, steps_decided=decided,
                   steps_decided_identical=agreeing)
    else:
        out.update(tokens_identical_where_decided=None,
                   tokens_note="GPT-2's step has no LM head: no tokens")
    return out


def time_steps(pair: Pair, batch: int, past: int, reps: int) -> dict[str, float]:
    """Median microseconds of a decode step at ``batch`` from a cache of ``past`` tokens,
    ``reps`` consecutive steps each (after 3 unmeasured), one GPU then two."""
    model = pair.model
    x = pair.embeddings(np.arange(batch))
    result = {}
    for system, step in (("1gpu", pair.step_one), ("2gpu", pair.step_two)):
        caches = pair.start(batch, past, seed=past)
        times = []
        for i in range(3 + reps):
            inputs = model.step_inputs(x, position=past + i)
            started = time.perf_counter()
            step(inputs, caches if i == 0 else None)  # logits on the host: synchronized
            if i >= 3:
                times.append((time.perf_counter() - started) * 1e6)
        result[system] = statistics.median(times)
    pair.reset()
    return result


def walk_range(pair: Pair, lengths: range) -> None:
    """Decode steps at batch 1 through every cache length of ``lengths`` on both: each
    shape recorded (one graph per topology, or one per shape)."""
    model = pair.model
    x = pair.embeddings(np.zeros(1, np.int64))
    caches = pair.start(1, lengths.start, seed=SEED + 3)
    for i, _ in enumerate(lengths):
        inputs = model.step_inputs(x, position=lengths.start + i)
        first = caches if i == 0 else None
        pair.step_one(inputs, first)
        pair.step_two(inputs, first)
    pair.reset()


def graph_memory(pair: Pair) -> dict:
    """Graph memory after every cache length of the declared range at batch 1."""
    lo, hi = pair.model.dims["past"]
    walk_range(pair, range(lo, hi))  # the step's output is one longer: hi - 1 is the last
    ranks = pair.rank_graph_memory()
    one = pair.one.backend.describe()
    return {"per_rank": [r["graph_device_bytes"] for r in ranks], "ranks": ranks,
            "1gpu": one["graph_device_bytes"], "lengths": hi - lo}


def per_shape_graph_memory(model: Model, artifacts: Path, sample: int) -> dict:
    """Bytes per graph, one graph per shape, over ``sample`` cache lengths, per rank and on
    one GPU, and the same times the declared range's lengths."""
    pair = Pair(model, artifacts, graph_mode="per-shape")
    try:
        lo, hi = model.dims["past"]
        walk_range(pair, range(lo, lo + sample))
        ranks = pair.rank_graph_memory()
        one = pair.one.backend.describe()
    finally:
        pair.close()
    per_graph = [r["graph_device_bytes"] / max(r["graphs_instantiated"], 1) for r in ranks]
    one_per_graph = one["graph_device_bytes"] / max(one["graphs_instantiated"], 1)
    return {"bytes_per_graph_per_rank": per_graph, "bytes_per_graph_1gpu": one_per_graph,
            "sampled_lengths": sample, "ranks": ranks,
            "over_range_per_rank": [b * (hi - lo) for b in per_graph],
            "over_range_1gpu": one_per_graph * (hi - lo)}


def run_model(name: str, args, torch) -> dict:
    model = Model(name, torch)
    print(f"{name}: {TENSOR_PARALLEL_MODELS[name]}", flush=True)
    pair = Pair(model, args.artifacts)
    try:
        decode = compare_decode(pair, args.steps)
        print(f"  {args.steps}-step decode: max_logit_diff {decode['max_logit_diff']:.2e}, "
              f"tokens identical where decided: {decode['tokens_identical_where_decided']}",
              flush=True)
        steps: dict[str, dict[str, float]] = {"1gpu": {}, "2gpu": {}}
        print(f"  {'step (us, median)':24s} {'1 GPU':>10s} {'2 GPUs':>10s} {'2/1':>6s}")
        for batch in model.batches:
            for past in args.pasts:
                if past + 3 + args.reps >= model.past_max:
                    continue
                got = time_steps(pair, batch, past, args.reps)
                key = f"batch{batch}_past{past}"
                for system, us in got.items():
                    steps[system][key] = us
                print(f"  {key:24s} {got['1gpu']:10.0f} {got['2gpu']:10.0f} "
                      f"{got['2gpu'] / got['1gpu']:6.2f}", flush=True)
        memory = graph_memory(pair)
    finally:
        pair.close()
    per_shape = per_shape_graph_memory(model, args.artifacts, args.per_shape_sample)
    over = [s / max(t, 1) for s, t in zip(per_shape["over_range_per_rank"], memory["per_rank"])]
    print(f"  graph memory per rank {memory['per_rank']} bytes; one graph per shape over "
          f"{memory['lengths']} lengths ~{[int(b) for b in per_shape['over_range_per_rank']]} "
          f"({[round(r, 1) for r in over]}x)", flush=True)
    return {
        "decode_step_us": steps,
        "max_logit_diff": decode["max_logit_diff"],
        "tokens_identical_where_decided": decode["tokens_identical_where_decided"],
        "graph_memory_bytes_per_rank": memory["per_rank"],
        "decode": decode,
        "graph_memory": memory,
        "per_shape_graph_memory": per_shape,
        "ratios": {
            "step_2gpu_over_1gpu": {k: steps["2gpu"][k] / steps["1gpu"][k] for k in steps["1gpu"]},
            "per_shape_over_topology_per_rank": over,
        },
        "dtype": model.dtype, "dims": model.dims,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="fewer lengths, reps and steps")
    parser.add_argument("--reps", type=int, default=20, help="timed steps per batch and length")
    parser.add_argument("--pasts", type=int, nargs="+", default=[128, 512, 992])
    parser.add_argument("--steps", type=int, default=DECODE_STEPS, help="decode steps compared")
    parser.add_argument("--per-shape-sample", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=list(TENSOR_PARALLEL_MODELS),
                        choices=list(TENSOR_PARALLEL_MODELS))
    args = parser.parse_args()
    import torch  # pylint: disable=import-outside-toplevel

    visible = torch.cuda.device_count()
    if visible < 2:
        print(f"tensor_parallel.py needs 2 GPUs, {visible} visible: not run", file=sys.stderr)
        raise SystemExit(2)
    if args.quick:
        args.reps, args.pasts, args.per_shape_sample = 5, [128], 8
    started = time.time()
    models = {name: run_model(name, args, torch) for name in args.models}
    names = [torch.cuda.get_device_name(i) for i in range(2)]
    result = {"machine": f"2x {names[0]}" if names[0] == names[1] else " + ".join(names),
              "command": "python3 bench/tensor_parallel.py " + " ".join(sys.argv[1:]),
              "torch": torch.__version__, "tolerance": TOLERANCE, "models": models}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tensor_parallel.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} in {time.time() - started:.0f} s")

if __name__ == "__main__":
    main()
