"""Benchmark: greedy generation as a Python loop over TVM's VM, as a Python loop over grape
graphs (one launch per token), and as one grape graph with a WHILE node (one launch per loop).

A GPT-2-style decoder with a static KV cache (``bench/models.py:decoder_step``,
``DECODER_BENCH``; weights from a seed, made here), batch 1 and 8, up to 256 new tokens.
The host-driven loops read the stop flag back after every token, as a Python decode loop
does; the device loop decides on the GPU. Each run starts from the same state, uploaded
before the clock starts. Where ``ARTIFACTS/sequential_launch/`` holds the decoder's loop
built without programmatic dependent launch (``build_artifacts.py``'s ``sequential_launch``
step), its two grape systems run beside the default build's in the same run.

    python3 bench/decode_loop.py --artifacts build/gpu --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import (  # noqa: E402  pylint: disable=wrong-import-position
    DECODER_BENCH,
    DECODER_SMALL,
    decoder_initial_state,
    decoder_state_names,
    decoder_weights,
)

MODELS = {"decoder": DECODER_BENCH, "decoder_small": DECODER_SMALL}  # artifact name: config
SYSTEMS = ("vm_loop", "grape_per_token", "grape_device_loop")
# The same loops built without programmatic dependent launch (build_artifacts.py's
# sequential_launch step), timed in the same run where that build exists.
SEQUENTIAL_DIR = "sequential_launch"
SEQUENTIAL_SYSTEMS = ("grape_per_token_sequential", "grape_device_loop_sequential")


class Setup:
    def __init__(self, artifacts: Path, name: str, eos: int):
        import tvm  # pylint: disable=import-outside-toplevel
        from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

        import grape_tvm  # pylint: disable=import-outside-toplevel
        from grape_tvm.loader import load_library  # pylint: disable=import-outside-toplevel

        self.tvm = tvm
        self.config = config = MODELS[name]
        self.carried = decoder_state_names(config["layers"])
        weights = decoder_weights(config["vocab"], config["hidden"], config["layers"],
                                  config["max_len"], seed=0)
        bound = {"eos": np.array([eos], np.int32), **weights}
        path = artifacts / f"{name}.loop.cuda.grape"
        sequential = artifacts / SEQUENTIAL_DIR / f"{name}.loop.cuda.grape"
        # system -> the loop it runs
        self.loops = {"grape_per_token": grape_tvm.load_loop(path, "cuda", mode="host"),
                      "grape_device_loop": grape_tvm.load_loop(path, "cuda", mode="device")}
        if sequential.exists():
            self.loops["grape_per_token_sequential"] = grape_tvm.load_loop(
                sequential, "cuda", mode="host")
            self.loops["grape_device_loop_sequential"] = grape_tvm.load_loop(
                sequential, "cuda", mode="device")
        self.systems = SYSTEMS + tuple(s for s in SEQUENTIAL_SYSTEMS if s in self.loops)
        for loop in self.loops.values():
            loop.bind_inputs(bound)
        library, _, self.dev = load_library(artifacts / f"{name}.tvm_vm.cuda.grape", "cuda")
        self.vm = VirtualMachine(library, self.dev)
        self.fixed = [tvm.runtime.tensor(v, self.dev) for v in bound.values()]

    def set_eos(self, eos: int) -> None:
        value = np.array([eos], np.int32)
        for loop in self.loops.values():
            loop.bind_inputs({"eos": value})
        self.fixed[0] = self.tvm.runtime.tensor(value, self.dev)

    def initial(self, batch: int) -> dict:
        config = self.config
        state = decoder_initial_state(batch, config["heads"], config["hidden"] // config["heads"],
                                      config["layers"], config["max_len"])
        return {k: self.tvm.runtime.tensor(v, self.dev) for k, v in state.items()}

    def close(self) -> None:
        for loop in self.loops.values():
            loop.close()


def vm_loop(s: Setup, state: dict, max_steps: int) -> tuple[dict, int]:
    steps, carried = 0, s.carried
    while steps < max_steps:
        out = s.vm["main"](*[state[n] for n in carried], *s.fixed)
        steps += 1
        state = dict(zip(carried, out[:len(carried)]))
        if out[len(carried)].numpy().any():
            break
    return state, steps


def run_system(s: Setup, system: str, batch: int, max_steps: int) -> dict:
    """One generation from the initial state: seconds, steps, tokens, host seconds."""
    state = s.initial(batch)
    if system.startswith("grape_device_loop"):
        loop = s.loops[system]
        # The loop's own buffers, reset to the initial state before the clock starts: the
        # timed call finds the state where it already is.
        warm = loop.run(state, max_steps=1).state
        for name in s.carried:
            warm[name].copyfrom(state[name])
        s.dev.sync()
        t0 = time.perf_counter()
        result = loop.run(warm, max_steps)
        seconds = time.perf_counter() - t0
        return {"s": seconds, "steps": result.steps, "host_s": loop.runner.last_host_s,
                "tokens": result.state["tokens"].numpy()}
    s.dev.sync()
    t0 = time.perf_counter()
    if system == "vm_loop":
        final, steps = vm_loop(s, state, max_steps)
    else:
        result = s.loops[system].run(state, max_steps)
        final, steps = result.state, result.steps
    s.dev.sync()
    seconds = time.perf_counter() - t0
    return {"s": seconds, "steps": steps, "tokens": final["tokens"].numpy()}


def measure(s: Setup, max_new_tokens: int, reps: int) -> dict:
    """Every system at batch 1 and 8: tokens/s, us per step, device-loop host time."""
    tokens_per_s: dict[str, dict[str, float]] = {k: {} for k in s.systems}
    step_us: dict[str, dict[str, float]] = {k: {} for k in s.systems}
    host_us_per_token: dict[str, float] = {}
    identical, steps_seen = True, {}
    for batch in (1, 8):
        reference = None
        for system in s.systems:
            run_system(s, system, batch, max_new_tokens)  # warm: records, builds graphs
            runs = [run_system(s, system, batch, max_new_tokens) for _ in range(reps)]
            seconds = statistics.median(r["s"] for r in runs)
            steps = runs[0]["steps"]
            steps_seen[f"{system}/{batch}"] = steps
            tokens_per_s[system][str(batch)] = batch * steps / seconds
            step_us[system][str(batch)] = seconds / steps * 1e6
            if system == "grape_device_loop":
                host_us_per_token[str(batch)] = statistics.median(
                    r["host_s"] for r in runs) / steps * 1e6
            for r in runs:
                reference = r["tokens"] if reference is None else reference
                identical &= bool(np.array_equal(r["tokens"], reference)) and r["steps"] == steps
            print(f"batch {batch} {system:18s} {steps} steps  {seconds * 1e3:8.2f} ms  "
                  f"{tokens_per_s[system][str(batch)]:10.0f} tokens/s", flush=True)
    speedup = {b: tokens_per_s["grape_device_loop"][b] / tokens_per_s["grape_per_token"][b]
               for b in ("1", "8")}
    return {"tokens_per_s": tokens_per_s, "step_us": step_us,
            "host_us_per_token": host_us_per_token, "speedup": speedup, "steps": steps_seen,
            "identical": identical}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    models = {}
    for name, config in MODELS.items():
        print(f"== {name}: {config}", flush=True)
        s = Setup(args.artifacts, name, eos=config["vocab"] + 1)  # EOS never produced
        found = measure(s, args.max_new_tokens, args.reps)
        found["early_stop"] = early_stop_check(s)
        found["config"] = config
        s.close()
        models[name] = found
        print(f"{'tokens/s':28s} {'batch 1':>10s} {'batch 8':>10s}")
        for system in s.systems:
            print(f"{system:28s} " + " ".join(f"{found['tokens_per_s'][system][b]:10.0f}"
                                              for b in ("1", "8")))
        print("device loop / per-token launches:",
              {b: round(v, 2) for b, v in found["speedup"].items()},
              " device loop host us per token:", found["host_us_per_token"], flush=True)
    main_model = models["decoder"]
    import torch  # pylint: disable=import-outside-toplevel

    result = {
        "machine": f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "command": "bash bench/gpu/run_all.sh (python3 bench/decode_loop.py --artifacts build/gpu --out $OUT)",
        "model": f"GPT-2-style decoder, static KV cache, {DECODER_BENCH}, fp32, greedy",
        "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": main_model["tokens_per_s"],
        "step_us": main_model["step_us"],
        "host_us_per_token": {"grape_device_loop": main_model["host_us_per_token"]["1"]},
        "device_loop_speedup_over_per_token": main_model["speedup"],
        # the device loop's step built without programmatic dependent launch over the default
        "sequential_launch_over_default": {
            b: main_model["step_us"]["grape_device_loop_sequential"][b]
            / main_model["step_us"]["grape_device_loop"][b] for b in ("1", "8")}
        if "grape_device_loop_sequential" in main_model["step_us"] else None,
        "tokens_identical": all(m["identical"] and m["early_stop"]["identical"]
                                for m in models.values()),
        "models": models,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_loop.json").write_text(json.dumps(result, indent=2))
    plot(models, args.out / "decode_loop.png")


def early_stop_check(s: Setup) -> dict:
    """EOS set to the token the decoder produces at step 40 (batch 1): all three stop at
    the same step, by step 40, with the same tokens."""
    free = run_system(s, "vm_loop", 1, 64)["tokens"]
    eos = int(free[0, 40])
    s.set_eos(eos)
    runs = {system: run_system(s, system, 1, 256) for system in s.systems}
    steps = {k: r["steps"] for k, r in runs.items()}
    same = all(np.array_equal(r["tokens"], runs["vm_loop"]["tokens"]) for r in runs.values())
    out = {"eos": eos, "steps": steps, "identical": same and len(set(steps.values())) == 1}
    print("early stop:", out, flush=True)
    return out


def plot(models: dict, path: Path) -> None:
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5))
    width = 0.25
    for ax, (name, found) in zip(axes, models.items()):
        for i, system in enumerate(SYSTEMS):
            values = [found["tokens_per_s"][system][b] for b in ("1", "8")]
            ax.bar([x + i * width for x in range(2)], values, width, label=system)
        ax.set_xticks([x + width for x in range(2)], ["batch 1", "batch 8"])
        ax.set_ylabel("generated tokens / s")
        config = found["config"]
        ax.set_title(f"{name}: {config['layers']} layers, hidden {config['hidden']}", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.suptitle("Greedy decoding, 256 new tokens, H200")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
