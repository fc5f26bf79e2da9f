"""Benchmark: Hugging Face GPT-2 (124M, fp32 or fp16) and Wav2Vec2 base end to end, every
system on the same weights (issue #6).

Weights are created here from the config and seed in ``NAME.weights.json``
(``bench/export_hf.py``: ``make_model`` for PyTorch, ``hf_weights`` for the artifacts);
artifacts are built on the CPU machine by ``bench/gpu/build_artifacts.py`` (``build_hf_models``).
Systems:

- ``grape``: grape-tvm (``load(..., "cuda")``, weights bound once, caches kept on the device)
- ``grape_sequential_launch`` (decode step only, where ``ARTIFACTS/sequential_launch/`` holds
  it): the same built without programmatic dependent launch
- ``tvm_vm``: TVM's VM on TVM's own CUDA build of the same imported module
- ``vm_grape_kernels``: TVM's VM on grape's library (grape's kernels, launched one by one)
- ``tvm_cuda_graph``: the same with TVM's CUDA-graph option (``relax.backend.use_cuda_graph``)
- ``torch_eager``: the transformers model, explicit KV cache (a ``DynamicCache`` per step)
- ``torch_graph_per_shape``: the same, one ``torch.cuda.CUDAGraph`` per past length, the
  cache copied into its static inputs on every step (the usual CUDA-graph practice)
- ``torch_compiled``: ``torch.compile(mode="reduce-overhead")`` with a ``StaticCache`` (the
  recommended PyTorch fast path); where it fails, ``torch_graph_per_shape`` stands in and
  the result says so (``torch_compiled_mode``)

Measured: (1) decode-step latency, batch 1, at several past lengths (median of ``--reps``,
synchronized); (2) greedy generation, a 16-token prompt then ``--max-new-tokens`` tokens
(prefill, then decode steps fed the previous step's cache), argmax on the device,
tokens/s end to end, tokens compared with PyTorch eager's; (3) device memory of grape's
graphs after the generation against one graph per shape (grape's per-shape mode on the
same calls); (4) the GPU-busy floor of grape's kernels at each past length; (5) Wav2Vec2
latency across audio lengths, where its artifacts were built.

    python3 bench/hf_models.py --artifacts build/gpu --out OUT_DIR
    python3 bench/hf_models.py --device cpu --tiny --build-dev /tmp/hf_dev   # CPU dev run

``--dtype float16``: GPT-2 in fp16 (artifacts ``gpt2_*_fp16``; weights, cache and logits
fp16, PyTorch's model cast to fp16 too), results in ``models_fp16.json``; no Wav2Vec2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from export_hf import (  # noqa: E402  pylint: disable=wrong-import-position
    cache_argument, dynamic_cache, hf_weights, make_model, returned_cache)

PAST = [1, 64, 256, 512, 1024]
PREFILL_LENGTHS = (16, 128, 512, 1024)  # prompt lengths the prefill is timed at
STEP_SYSTEMS = ["grape", "grape_sequential_launch", "vm_grape_kernels", "tvm_vm",
                "tvm_cuda_graph", "torch_eager", "torch_graph_per_shape", "torch_compiled"]
# The decode step built without programmatic dependent launch (build_artifacts.py's
# sequential_launch step): timed as "grape_sequential_launch" where it exists.
SEQUENTIAL_DIR = "sequential_launch"
GEN_SYSTEMS = ["torch_eager", "torch_compiled", "tvm_vm", "tvm_cuda_graph", "vm_grape_kernels",
               "grape", "graph_per_shape"]
AUDIO_SECONDS = [1, 2, 4, 8, 16]
SAMPLE_RATE = 16000


def _error(err: BaseException) -> str:
    text = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {text[-1][:300] if text else ''}"


def _median_us(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class Env:
    """The device, torch and TVM, and where the artifacts are."""

    def __init__(self, artifacts: Path, device: str, tiny: bool, dtype: str = "float32"):
        import torch  # pylint: disable=import-outside-toplevel
        import tvm  # pylint: disable=import-outside-toplevel

        # fp32 means fp32 on PyTorch's side too: cuDNN's convolutions default to TF32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.torch, self.tvm = torch, tvm
        self.artifacts, self.device, self.tiny = artifacts, device, tiny
        self.cuda = device == "cuda"
        self.kind = "cuda" if self.cuda else "llvm"
        # export_hf's names: NAME[_fp16][_tiny]
        self.suffix = ("_fp16" if dtype == "float16" else "") + ("_tiny" if tiny else "")
        self.dtype = dtype  # the model's weights, KV cache and logits
        self.np_dtype = np.dtype(dtype)
        self.torch_dtype = getattr(torch, dtype)

    def path(self, model: str, system: str = "") -> Path:
        return self.artifacts / f"{model}{self.suffix}{'.' + system if system else ''}.{self.kind}.grape"

    def weights_json(self, model: str) -> Path:
        return self.artifacts / f"{model}{self.suffix}.weights.json"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def load(self, model: str, mode: str = "topology"):
        from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

        if self.cuda:
            return load(self.path(model), "cuda", graph_mode=mode)
        return load(self.path(model), "cpu")


class VM:
    """TVM's VM on an artifact's library; arguments by the artifact's input names."""

    def __init__(self, env: Env, path: Path, weights: dict):
        from tvm.runtime.vm import VirtualMachine  # pylint: disable=import-outside-toplevel

        from grape_tvm.loader import entry_argument, load_library  # pylint: disable=import-outside-toplevel
        from grape_tvm.runtime.signature import Signature  # pylint: disable=import-outside-toplevel

        library, manifest, self.dev = load_library(path, env.device)
        self.vm = VirtualMachine(library, self.dev)
        signature = Signature.from_json(manifest["signature"])
        self.inputs = [t.name for t in signature.inputs]
        self.outputs = [t.name for t in signature.outputs]
        self.template = [entry_argument(manifest, n, weights[n], self.dev) if n in weights else None
                         for n in self.inputs]
        self.position = {n: i for i, n in enumerate(self.inputs)}

    def __call__(self, feeds: dict) -> dict:
        args = list(self.template)
        for name, value in feeds.items():
            args[self.position[name]] = value
        result = self.vm["main"](*args)
        if len(self.outputs) == 1:
            result = [result]
        return dict(zip(self.outputs, result))


# -- PyTorch side -------------------------------------------------------------------------

class TorchGpt2:
    """The transformers model with an explicit KV cache, across transformers versions."""

    def __init__(self, torch, model, device: str):
        self.torch, self.device = torch, device
        self.model = model.to(device)
        self.cache_kw = cache_argument(self.model)
        cfg = self.model.config
        self.layers, self.heads = cfg.n_layer, cfg.n_head
        self.head_dim, self.vocab = cfg.n_embd // cfg.n_head, cfg.vocab_size
        self.positions = cfg.n_positions

    @staticmethod
    def presents(out) -> list:
        cache = returned_cache(out)
        if hasattr(cache, "layers"):
            return [t for layer in cache.layers for t in (layer.keys, layer.values)]
        if hasattr(cache, "key_cache"):
            return [t for pair in zip(cache.key_cache, cache.value_cache) for t in pair]
        return [t for pair in cache for t in pair]

    def step(self, ids, past: list) -> tuple:
        """Logits and the presents, from ``ids [1, n]`` and ``past`` (a list of 2 * layers)."""
        with self.torch.no_grad():
            kwargs = {self.cache_kw: dynamic_cache(past)} if past else {}
            out = self.model(ids, use_cache=True, **kwargs)
        return out.logits, self.presents(out)


def _argmax(torch, logits):
    """The next token of each sequence, ``[batch, 1]`` int64, on the logits' device."""
    return torch.argmax(logits[:, -1, :], dim=-1, keepdim=True)


class TorchGraphs:
    """One CUDA graph of the explicit-cache step per past length, on static inputs."""

    def __init__(self, tm: TorchGpt2):
        self.tm, self.torch = tm, tm.torch
        self.graphs: dict[int, tuple] = {}
        self.pool = self.torch.cuda.graph_pool_handle()

    def graph(self, length: int):
        if length not in self.graphs:
            torch, tm = self.torch, self.tm
            ids = torch.zeros((1, 1), dtype=torch.int64, device="cuda")
            past = [torch.zeros((1, tm.heads, length, tm.head_dim), device="cuda",
                                dtype=tm.model.dtype)
                    for _ in range(2 * tm.layers)]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    tm.step(ids, past)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, presents = tm.step(ids, past)
            self.graphs[length] = (graph, ids, past, logits, presents)
        return self.graphs[length]

    def step(self, ids, past: list) -> tuple:
        graph, s_ids, s_past, logits, presents = self.graph(int(past[0].shape[2]))
        s_ids.copy_(ids)
        for dst, src in zip(s_past, past):
            dst.copy_(src)
        graph.replay()
        return logits, presents


class TorchCompiled:
    """``torch.compile(mode="reduce-overhead")`` of the decode step on a ``StaticCache``
    of ``max_len`` positions; the prefill runs eagerly into the same cache."""

    def __init__(self, tm: TorchGpt2, max_len: int):
        from transformers.cache_utils import StaticCache  # pylint: disable=import-outside-toplevel

        self.tm, self.torch = tm, tm.torch
        cfg = tm.model.config
        try:
            self.cache = StaticCache(config=cfg, max_cache_len=max_len)
        except TypeError:  # transformers 4.x
            self.cache = StaticCache(config=cfg, max_batch_size=1, max_cache_len=max_len,
                                     device=tm.device, dtype=tm.model.dtype)
        mode = "reduce-overhead" if tm.device == "cuda" else "default"
        self.compiled = self.torch.compile(self._decode, mode=mode, fullgraph=True)

    def _forward(self, ids, position):
        out = self.tm.model(ids, use_cache=True, cache_position=position,
                            **{self.tm.cache_kw: self.cache})
        return out.logits

    def _decode(self, ids, position):
        return self._forward(ids, position)

    def prefill(self, ids):
        self.cache.reset()
        with self.torch.no_grad():
            position = self.torch.arange(ids.shape[1], device=ids.device)
            return self._forward(ids, position)

    def decode(self, ids, position):
        with self.torch.no_grad():
            logits = self.compiled(ids, position)
        return logits.clone() if self.tm.device == "cuda" else logits  # outlives the next replay


# -- GPT-2 ---------------------------------------------------------------------------------

class Gpt2Bench:
    def __init__(self, env: Env, reps: int, compile_torch: bool):
        torch, tvm = env.torch, env.tvm
        self.env, self.torch, self.tvm, self.reps = env, torch, tvm, reps
        self.notes: dict = {}
        self.errors: dict = {}  # system -> past length -> the error a step measurement raised
        spec = json.loads(env.weights_json("gpt2_decode").read_text())
        config = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()}
        self.tm = TorchGpt2(torch, make_model("gpt2", config, spec["seed"],
                                              spec.get("dtype", "float32")), env.device)
        weights_np = {**hf_weights(env.weights_json("gpt2_prefill")),
                      **hf_weights(env.weights_json("gpt2_decode"))}
        self.executors: dict = {}
        self.grape = {m: env.load(m) for m in ("gpt2_prefill", "gpt2_decode")}
        self.dev = self.grape["gpt2_decode"].device
        self.weights = {k: tvm.runtime.tensor(v, self.dev) for k, v in weights_np.items()}
        sequential = env.artifacts / SEQUENTIAL_DIR / env.path("gpt2_decode").name
        self.sequential = None
        if env.cuda and sequential.exists():
            from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

            self.sequential = load(sequential, "cuda")
        for ex in [*self.grape.values(), *([self.sequential] if self.sequential else [])]:
            ex.bind_inputs({k: self.weights[k] for k in self._input_names(ex) if k in self.weights})
        self.vms: dict[str, dict] = {}
        baselines = env.artifacts / "hf_baselines.json"
        built = json.loads(baselines.read_text()) if baselines.exists() else {}
        for system in ("tvm_vm", "tvm_cuda_graph"):
            if system == "tvm_cuda_graph" and not env.cuda:
                self.notes[system] = "needs CUDA"
                continue
            paths = {m: env.path(m, system) for m in ("gpt2_prefill", "gpt2_decode")}
            missing = [str(p) for p in paths.values() if not p.exists()]
            if missing:
                why = {m: built.get(m + env.suffix, built.get(m, {})).get(system) for m in paths}
                self.notes[system] = f"not built: {missing} ({why})"
                continue
            try:
                self.vms[system] = {m: VM(env, p, self.weights) for m, p in paths.items()}
                self.notes[system] = {m: built.get(m + env.suffix, built.get(m, {})).get(system)
                                      for m in paths}
            except Exception as err:  # pylint: disable=broad-except
                self.notes[system] = f"failed to load: {_error(err)}"
        # TVM's VM on grape's own library: the same kernels as grape, launched one by one.
        # It separates what grape's schedules win from what its graphs win.
        self.vms["vm_grape_kernels"] = {m: VM(env, env.path(m), self.weights)
                                        for m in ("gpt2_prefill", "gpt2_decode")}
        self.notes["vm_grape_kernels"] = "TVM's VM running grape's artifact library (same kernels)"
        self.graphs = TorchGraphs(self.tm) if env.cuda else None
        if not env.cuda:
            self.notes["torch_graph_per_shape"] = "needs CUDA"
        self.hi = self.grape["gpt2_decode"].signature.dims["past"].hi
        self.compiled = None
        self.compiled_mode = "not run (--no-compile)"
        if compile_torch:
            self._compile(min(self.hi, self.tm.positions))

    def _compile(self, max_len: int) -> None:
        """The compiled step, compiled now (an eager prefill, then decode calls), untimed."""
        torch = self.torch
        try:
            self.compiled = TorchCompiled(self.tm, max_len)
            t0 = time.perf_counter()
            self.generate("torch_compiled", torch.zeros((1, 4), dtype=torch.int64,
                                                        device=self.env.device), 4)
            self.env.sync()
            self.notes["torch_compile_s"] = time.perf_counter() - t0
            print(f"torch.compile: {self.notes['torch_compile_s']:.1f} s", flush=True)
            mode = "reduce-overhead" if self.env.cuda else "default"
            self.compiled_mode = (f"torch.compile(mode='{mode}', fullgraph=True) of the decode "
                                  f"step, StaticCache(max_cache_len={max_len}), eager prefill")
        except Exception as err:  # pylint: disable=broad-except
            traceback.print_exc()
            self.compiled_mode = f"failed: {_error(err)}"
            self.compiled = None

    @staticmethod
    def _input_names(ex) -> list[str]:
        return [t.name for t in ex.signature.inputs]

    def kv_names(self, prefix: str) -> list[str]:
        return [f"{prefix}_{i}_{kv}" for i in range(self.tm.layers) for kv in ("key", "value")]

    def grape_sync(self, ex) -> None:
        ex.backend.synchronize()

    # -- (1) one decode step at a past length -------------------------------------------
    def step_latency(self, lengths: list[int]) -> dict:
        torch, tm = self.torch, self.tm
        out: dict[str, dict] = {s: {} for s in STEP_SYSTEMS}
        for length in lengths:
            rng = np.random.default_rng(length)
            past_np = [(0.5 * rng.standard_normal((1, tm.heads, length, tm.head_dim)))
                       .astype(self.env.np_dtype) for _ in range(2 * tm.layers)]
            ids_np = rng.integers(0, tm.vocab, (1, 1)).astype(np.int64)
            past_tvm = dict(zip(self.kv_names("past"),
                                (self.tvm.runtime.tensor(a, self.dev) for a in past_np)))
            ids_tvm = self.tvm.runtime.tensor(ids_np, self.dev)
            past_t = [torch.from_numpy(a).to(self.env.device) for a in past_np]
            ids_t = torch.from_numpy(ids_np).to(self.env.device)
            feeds = {"input_ids": ids_tvm, **past_tvm}
            ex = self.grape["gpt2_decode"]
            calls = {}

            def grape():
                ex.run(feeds, return_numpy=False)
                self.grape_sync(ex)

            calls["grape"] = grape
            if self.sequential is not None:
                def sequential(ex=self.sequential):
                    ex.run(feeds, return_numpy=False)
                    self.grape_sync(ex)
                calls["grape_sequential_launch"] = sequential
            for system, vms in self.vms.items():
                def vm(v=vms["gpt2_decode"]):
                    v(feeds)
                    self.dev.sync()
                calls[system] = vm

            def eager():
                tm.step(ids_t, past_t)
                self.env.sync()

            calls["torch_eager"] = eager
            if self.graphs is not None:
                def graphed():
                    self.graphs.step(ids_t, past_t)
                    self.env.sync()
                calls["torch_graph_per_shape"] = graphed
            if self.compiled is not None and length < tm.positions:
                # a slice of a range, as the generation passes positions
                position = torch.arange(tm.positions, device=self.env.device)[length:length + 1]

                def compiled():
                    self.compiled.decode(ids_t, position)
                    self.env.sync()
                calls["torch_compiled"] = compiled
            for system, call in calls.items():
                try:
                    out[system][str(length)] = _median_us(
                        call, self.reps, warmup=3 if system == "torch_compiled" else 2)
                except Exception as err:  # pylint: disable=broad-except
                    traceback.print_exc()
                    self.errors.setdefault(system, {})[str(length)] = _error(err)
                    if system == "torch_compiled":
                        self.compiled_mode = f"failed: {_error(err)}"
                        self.compiled = None
            print(f"  past {length:5d}: " + " ".join(
                f"{s}={out[s][str(length)]:.0f}" for s in STEP_SYSTEMS if str(length) in out[s]),
                flush=True)
        return {s: v for s, v in out.items() if v}

    # -- (1b) the prefill of a prompt ----------------------------------------------------
    def prefill_latency(self, lengths: list[int]) -> dict:
        """A prompt of each length, batch 1, through the prefill (logits and the cache):
        grape, TVM's VM, PyTorch eager and ``torch.compile(mode="reduce-overhead")`` of the
        forward without its cache (compiled once per length, a static shape; the compile
        untimed). Into a ``StaticCache`` the compiled prefill crashed the process on the
        H200 (a segfault in an Inductor kernel launch, cudagraphs skipped for the cache's
        mutated inputs); without the cache it computes the same keys and values and does
        not return them (a few MB of writes less)."""
        torch, tm = self.torch, self.tm
        out: dict[str, dict] = {}
        mode = "reduce-overhead" if self.env.cuda else "default"
        compiled = None
        if self.compiled is not None:
            def prefill(ids):
                return tm.model(ids, use_cache=False).logits

            compiled = torch.compile(prefill, mode=mode, fullgraph=True, dynamic=False)
        for length in lengths:
            ids_np = np.random.default_rng(length).integers(0, tm.vocab, (1, length))
            ids_t = torch.from_numpy(ids_np.astype(np.int64)).to(self.env.device)
            feeds = {"input_ids": self.tvm.runtime.tensor(ids_np.astype(np.int64), self.dev)}
            ex = self.grape["gpt2_prefill"]
            calls = {"grape": lambda: (ex.run(feeds, return_numpy=False), self.grape_sync(ex))}
            for system, vms in self.vms.items():
                calls[system] = lambda v=vms["gpt2_prefill"]: (v(feeds), self.dev.sync())

            def eager():
                with torch.no_grad():
                    tm.model(ids_t, use_cache=True)
                self.env.sync()

            calls["torch_eager"] = eager
            if compiled is not None:
                def compiled_call():
                    with torch.no_grad():
                        compiled(ids_t)
                    self.env.sync()

                calls["torch_compiled"] = compiled_call
            for system, call in calls.items():
                try:
                    out.setdefault(system, {})[str(length)] = _median_us(
                        call, self.reps, warmup=3 if system == "torch_compiled" else 2)
                except Exception as err:  # pylint: disable=broad-except
                    traceback.print_exc()
                    self.errors.setdefault(f"prefill/{system}", {})[str(length)] = _error(err)
            print(f"  prefill {length:5d}: " + " ".join(
                f"{s}={v[str(length)]:.0f}" for s, v in out.items() if str(length) in v),
                flush=True)
        return out

    # -- (2) greedy generation ------------------------------------------------------------
    def _from_tvm(self, tensor):
        return self.torch.from_dlpack(tensor)

    def _to_tvm(self, tensor):
        try:
            return self.tvm.runtime.from_dlpack(tensor)
        except RuntimeError:  # TVM wants 64-byte aligned data: a fresh torch allocation is
            return self.tvm.runtime.from_dlpack(tensor.clone())

    def generate(self, system: str, prompt, new_tokens: int, executors=None):
        """``new_tokens`` greedy tokens after ``prompt`` (torch ``[1, n]`` int64 on the
        device); returns them as a ``[1, new_tokens]`` torch tensor. No host sync inside:
        the next token goes from one step to the next on the device."""
        torch, tm = self.torch, self.tm
        tokens = []
        if system in ("torch_eager", "torch_graph_per_shape"):
            logits, past = tm.step(prompt, [])
            tok = _argmax(torch, logits)
            step = tm.step if system == "torch_eager" else self.graphs.step
            for _ in range(new_tokens - 1):
                tokens.append(tok)
                logits, past = step(tok, past)
                tok = _argmax(torch, logits)
        elif system == "torch_compiled":
            logits = self.compiled.prefill(prompt)
            tok = _argmax(torch, logits)
            length = prompt.shape[1]
            positions = torch.arange(length, length + new_tokens, device=prompt.device)
            for t in range(new_tokens - 1):
                tokens.append(tok)
                logits = self.compiled.decode(tok, positions[t:t + 1])
                tok = _argmax(torch, logits)
        elif system in self.vms:
            vms = self.vms[system]
            out = vms["gpt2_prefill"]({"input_ids": self._to_tvm(prompt)})
            tok = _argmax(torch, self._from_tvm(out["logits"]))
            for _ in range(new_tokens - 1):
                tokens.append(tok)
                feeds = {p: out[q] for p, q in zip(self.kv_names("past"), self.kv_names("present"))}
                out = vms["gpt2_decode"]({"input_ids": self._to_tvm(tok), **feeds})
                tok = _argmax(torch, self._from_tvm(out["logits"]))
        else:  # grape, in either graph mode
            prefill, decode = executors or (self.grape["gpt2_prefill"], self.grape["gpt2_decode"])
            out = prefill.run({"input_ids": self._to_tvm(prompt)}, return_numpy=False)
            tok = _argmax(torch, self._from_tvm(out["logits"]))
            for _ in range(new_tokens - 1):
                tokens.append(tok)
                feeds = {p: out[q] for p, q in zip(self.kv_names("past"), self.kv_names("present"))}
                out = decode.run({"input_ids": self._to_tvm(tok), **feeds}, return_numpy=False)
                tok = _argmax(torch, self._from_tvm(out["logits"]))
        tokens.append(tok)
        return torch.cat(tokens, dim=1)

    def generation(self, prompt_len: int, new_tokens: int, runs: int, executors: dict) -> dict:
        """Every system's greedy generation, timed; ``executors``: the grape executors
        (prefill, decode) of ``grape`` and ``graph_per_shape``."""
        torch = self.torch
        prompt = torch.tensor(np.random.default_rng(7).integers(0, self.tm.vocab, (1, prompt_len)),
                              dtype=torch.int64, device=self.env.device)
        systems = [s for s in GEN_SYSTEMS if s in ("torch_eager", "grape") or s in self.vms
                   or (s == "torch_compiled" and self.compiled is not None)
                   or (s == "graph_per_shape" and s in executors)]
        if self.compiled is None and self.graphs is not None:
            systems.append("torch_graph_per_shape")  # the fast path's stand-in
        result: dict = {"tokens_per_s": {}, "seconds": {}, "tokens_identical": {},
                        "first_difference_at": {}, "errors": {}}
        reference = None
        for system in systems:
            name = "grape" if system == "graph_per_shape" else system
            pair = executors.get(system)
            try:
                t0 = time.perf_counter()
                tokens = self.generate(name, prompt, new_tokens, pair)  # first run: records
                self.env.sync()
                first = time.perf_counter() - t0
                times = []
                for _ in range(runs):
                    self.env.sync()
                    t0 = time.perf_counter()
                    tokens = self.generate(name, prompt, new_tokens, pair)
                    self.env.sync()
                    times.append(time.perf_counter() - t0)
            except Exception as err:  # pylint: disable=broad-except
                traceback.print_exc()
                result["errors"][system] = _error(err)
                if system == "torch_compiled":
                    self.compiled_mode = f"failed: {_error(err)}"
                continue
            got = tokens.cpu().numpy()[0]
            if reference is None:
                reference = got  # torch_eager runs first
            seconds = statistics.median(times)
            result["tokens_per_s"][system] = new_tokens / seconds
            result["seconds"][system] = {"median": seconds, "first_run": first}
            same = got.shape == reference.shape and bool((got == reference).all())
            result["tokens_identical"][system] = same
            if not same:
                diff = np.nonzero(got[:len(reference)] != reference[:len(got)])[0]
                result["first_difference_at"][system] = int(diff[0]) if len(diff) else -1
            print(f"  {system:22s} {new_tokens / seconds:8.1f} tokens/s  identical={same}"
                  f"  (first run {first:.2f} s)", flush=True)
        result["tokens_torch_eager"] = reference.tolist() if reference is not None else None
        if "torch_compiled" not in result["tokens_per_s"] and "torch_graph_per_shape" in result["tokens_per_s"]:
            result["tokens_per_s"]["torch_compiled"] = result["tokens_per_s"]["torch_graph_per_shape"]
            result["tokens_identical"]["torch_compiled"] = result["tokens_identical"]["torch_graph_per_shape"]
            self.compiled_mode = (f"stand-in: manual CUDA graph per past length "
                                  f"(torch.compile path: {self.compiled_mode})")
        return result

    # -- (3) graph memory ----------------------------------------------------------------------
    def fresh(self, mode: str, models: tuple = ("gpt2_prefill", "gpt2_decode")) -> tuple:
        """New grape executors (nothing recorded yet), weights bound."""
        executors = []
        for model in models:
            ex = self.env.load(model, mode)
            ex.bind_inputs({k: self.weights[k] for k in self._input_names(ex) if k in self.weights})
            executors.append(ex)
        return tuple(executors)

    # -- (4) GPU-busy floor ----------------------------------------------------------------
    def gpu_busy(self, lengths: list[int], launches: int = 20) -> dict:
        """The decode step's graphs at each past length (a fresh grape executor in per-shape
        mode) replayed back to back, timed with CUDA events: the GPU time of grape's kernels."""
        tm = self.tm

        def feeds(length):
            zeros = np.zeros((1, tm.heads, length, tm.head_dim), self.env.np_dtype)
            past = {n: self.tvm.runtime.tensor(zeros, self.dev) for n in self.kv_names("past")}
            return {"input_ids": self.tvm.runtime.tensor(np.zeros((1, 1), np.int64), self.dev),
                    **past}

        return self._busy("gpt2_decode", lengths, feeds, launches)

    def prefill_gpu_busy(self, lengths: list[int], launches: int = 20) -> tuple[dict, dict]:
        """As ``gpu_busy``, the prefill at each prompt length; and the timed executor's calls
        queued back to back (``launches`` calls, one sync): us per call, the larger of its
        host and GPU time per call."""
        def feeds(length):
            ids = np.zeros((1, length), np.int64)
            return {"input_ids": self.tvm.runtime.tensor(ids, self.dev)}

        queued = {}
        ex = self.grape["gpt2_prefill"]
        for length in lengths:
            inputs = feeds(length)
            ex.run(inputs, return_numpy=False)
            self.grape_sync(ex)
            t0 = time.perf_counter()
            for _ in range(launches):
                ex.run(inputs, return_numpy=False)
            self.grape_sync(ex)
            queued[str(length)] = (time.perf_counter() - t0) * 1e6 / launches
        return self._busy("gpt2_prefill", lengths, feeds, launches), queued

    def _busy(self, model: str, lengths: list[int], feeds_at, launches: int) -> dict:
        """``model``'s graphs at each length replayed back to back (a fresh executor in
        per-shape mode), timed with CUDA events: us per call."""
        from grape_tvm.runtime.cuda_driver import check, driver  # pylint: disable=import-outside-toplevel

        ex = self.fresh("per-shape", (model,))[0]
        backend = ex.backend
        start = check(driver.cuEventCreate(0), "cuEventCreate")
        stop = check(driver.cuEventCreate(0), "cuEventCreate")
        out = {}
        try:
            for length in lengths:
                feeds = feeds_at(length)
                before = set(backend._per_shape)  # pylint: disable=protected-access
                ex.run(feeds, return_numpy=False)
                ex.run(feeds, return_numpy=False)
                backend.synchronize()
                keys = [k for k in backend._per_shape if k not in before]  # pylint: disable=protected-access
                graphs = [backend._per_shape[k] for k in keys]  # pylint: disable=protected-access
                if not graphs:
                    continue
                check(driver.cuEventRecord(start, backend.stream), "cuEventRecord")
                for _ in range(launches):
                    for graph in graphs:
                        check(driver.cuGraphLaunch(graph.exec, backend.stream), "cuGraphLaunch")
                check(driver.cuEventRecord(stop, backend.stream), "cuEventRecord")
                check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
                ms = check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
                out[str(length)] = ms * 1e3 / launches
        finally:
            driver.cuEventDestroy(start)
            driver.cuEventDestroy(stop)
            ex.close()
        return out


def past_lengths(tm: TorchGpt2, hi: int) -> list[int]:
    """``PAST`` within the artifact's range, below the model's position limit (a step at
    past ``L`` reads position embedding ``L``: GPT-2 124M has 1024, so 1024 becomes 1023)."""
    top = min(hi, tm.positions - 1)
    return sorted({min(p, top) for p in PAST})


def run_gpt2(env: Env, args) -> dict:
    bench = Gpt2Bench(env, args.reps, not args.no_compile)
    lengths = past_lengths(bench.tm, bench.hi)
    print(f"GPT-2 decode step, batch 1, us (median of {args.reps})", flush=True)
    step_us = bench.step_latency(lengths)
    prompts = [n for n in PREFILL_LENGTHS if n <= bench.grape["gpt2_prefill"].signature.dims["seq"].hi]
    print(f"GPT-2 prefill, batch 1, us (median of {args.reps})", flush=True)
    prefill_us = bench.prefill_latency(prompts)
    print(f"GPT-2 greedy generation: prompt {args.prompt_len}, {args.max_new_tokens} new tokens",
          flush=True)
    # Fresh executors for the generation: their graphs serve exactly its calls, for (3).
    fresh = {"grape": bench.fresh("topology")}
    if env.cuda:
        fresh["graph_per_shape"] = bench.fresh("per-shape")
    gen = bench.generation(args.prompt_len, args.max_new_tokens, args.gen_runs, fresh)
    memory, graphs = {}, {}
    for system, executors in fresh.items():
        memory[system] = sum(int(getattr(ex.backend, "graph_device_bytes", 0)) for ex in executors)
        graphs[system] = {m: ex.backend.describe() for m, ex in zip(("prefill", "decode"), executors)}
    busy, prefill_busy, prefill_queued, busy_note = {}, {}, {}, None
    if env.cuda and not args.no_busy:
        try:
            busy = bench.gpu_busy(lengths)
            prefill_busy, prefill_queued = bench.prefill_gpu_busy(prompts)
            print("GPU busy (graphs replayed back to back), us: decode "
                  f"{ {k: round(v) for k, v in busy.items()} }, prefill "
                  f"{ {k: round(v) for k, v in prefill_busy.items()} }; prefill calls queued "
                  f"{ {k: round(v) for k, v in prefill_queued.items()} }", flush=True)
        except Exception as err:  # pylint: disable=broad-except
            busy_note = _error(err)
    instantiated = {s: sum(g.get("graphs_instantiated", 0) for g in d.values()) for s, d in graphs.items()}
    result = {
        "model": (f"GPT-2 ({bench.tm.layers} layers, {bench.tm.heads} heads, hidden "
                  f"{bench.tm.heads * bench.tm.head_dim}, vocab {bench.tm.vocab}), {env.dtype}, batch 1, "
                  "random weights from config and seed"),
        "tokens_per_s": gen["tokens_per_s"],
        "decode_step_us": step_us,
        "prefill_us": prefill_us,
        "prefill_lengths": prompts,
        "prefill_torch_compiled": ("torch.compile(mode='reduce-overhead', fullgraph=True, "
                                   "dynamic=False) of the forward without its cache "
                                   "(use_cache=False), per length"),
        "graph_memory_bytes": memory,
        "past_lengths": lengths,
        "generation": {k: v for k, v in gen.items() if k != "tokens_per_s"},
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
        "torch_compiled_mode": bench.compiled_mode,
        "graphs_instantiated": instantiated,
        "graph_memory_what": ("drop in free device memory across graph instantiations and table "
                              "writes (CudaGraphBackend.graph_device_bytes), prefill + decode "
                              "executors that ran the same greedy generation once"),
        "gpu_busy_us": busy,
        "prefill_gpu_busy_us": prefill_busy,
        "prefill_queued_us": prefill_queued,
        "notes": {**bench.notes, **({"gpu_busy": busy_note} if busy_note else {})},
        "decode_step_errors": bench.errors,
        "backend": graphs,
    }
    if memory.get("graph_per_shape", 0) > 0:
        per_graph = memory["graph_per_shape"] / max(instantiated.get("graph_per_shape", 1), 1)
        result["graph_per_shape_bytes_per_graph"] = per_graph
    # cudaMemGetInfo moves in 2 MiB pages and other frees land in the same window, so grape's
    # few graphs can read 0 or less: a ratio is only meaningful above that granularity.
    if memory.get("grape", 0) > 0 and memory.get("graph_per_shape", 0) > 0:
        result["graph_memory_per_shape_over_grape"] = memory["graph_per_shape"] / memory["grape"]
    if bench.sequential is not None:
        bench.sequential.close()
    for ex in (*[e for pair in fresh.values() for e in pair], *bench.grape.values()):
        ex.close()
    return result


# -- Wav2Vec2 ------------------------------------------------------------------------------

def run_wav2vec2(env: Env, args) -> dict:
    torch, tvm = env.torch, env.tvm
    grape_path = env.path("wav2vec2")
    found = sorted(p.name for p in env.artifacts.glob(f"wav2vec2*.{env.kind}.grape"))
    if not grape_path.exists():  # another name a build may have given it
        others = [n for n in found if ".tvm_" not in n]
        grape_path = env.artifacts / others[0] if others else grape_path
    weights_json = env.artifacts / (grape_path.name.split(".")[0] + ".weights.json")
    if not weights_json.exists():
        weights_json = env.weights_json("wav2vec2")
    if not grape_path.exists() or not weights_json.exists():
        return {"status": "not built",
                "reason": f"no {grape_path.name} with {weights_json.name} in {env.artifacts} "
                          f"(found {found}): run bench/gpu/build_artifacts.py (build_wav2vec2) "
                          "where torch and transformers are installed",
                "latency_ms": {}}
    spec = json.loads(weights_json.read_text())
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()}
    model = make_model("wav2vec2", config, spec["seed"]).to(env.device)
    from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

    # Loading an artifact first also loads TVM's CUDA runtime (a runtime-only TVM does not).
    grape = load(grape_path, "cuda") if env.cuda else load(grape_path, "cpu")
    weights = {k: tvm.runtime.tensor(v, tvm.device(env.device if env.cuda else "cpu", 0))
               for k, v in hf_weights(weights_json).items()}
    grape.bind_inputs({k: weights[k] for k in (t.name for t in grape.signature.inputs) if k in weights})
    dev = grape.device
    rng_samples = grape.signature.dims["samples"]
    lengths = [s * SAMPLE_RATE for s in AUDIO_SECONDS if rng_samples.lo <= s * SAMPLE_RATE <= rng_samples.hi]
    if not lengths:  # the tiny model: a few lengths of its range
        lengths = sorted({rng_samples.lo, (rng_samples.lo + rng_samples.hi) // 2, rng_samples.hi})
    vms, notes = {}, {}
    for system in ("tvm_vm", "tvm_cuda_graph"):
        path = env.path("wav2vec2", system)
        if path.exists():
            try:
                vms[system] = VM(env, path, weights)
            except Exception as err:  # pylint: disable=broad-except
                notes[system] = f"failed to load: {_error(err)}"
        else:
            notes[system] = f"not built ({path.name} missing)"
    vms["vm_grape_kernels"] = VM(env, grape_path, weights)  # grape's kernels, one by one
    graphs: dict[int, tuple] = {}

    def torch_graph(x):
        n = int(x.shape[1])
        if n not in graphs:
            static = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(2):
                    model(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                y = model(static).last_hidden_state
            graphs[n] = (graph, static, y)
        graph, static, y = graphs[n]
        static.copy_(x)
        graph.replay()
        return y

    latency: dict[str, dict] = {}
    err: dict[str, float] = {}
    rel_err: dict[str, float] = {}  # over the largest |output| of PyTorch's
    reps = max(3, args.reps // 2)
    for n in lengths:
        key = f"{n / SAMPLE_RATE:g}"
        audio = np.random.default_rng(n).standard_normal((1, n)).astype(np.float32)
        x_t = torch.from_numpy(audio).to(env.device)
        x_tvm = tvm.runtime.tensor(audio, dev)
        with torch.no_grad():
            want = model(x_t).last_hidden_state
        env.sync()
        want_np = want.cpu().numpy()

        def grape_call():
            y = grape.run({"input_values": x_tvm}, return_numpy=False)["last_hidden_state"]
            grape.backend.synchronize()
            return y

        systems = {"grape": grape_call}
        for system, vm in vms.items():
            def vm_call(v=vm):
                y = v({"input_values": x_tvm})["last_hidden_state"]
                dev.sync()
                return y
            systems[system] = vm_call

        def eager():
            with torch.no_grad():
                y = model(x_t).last_hidden_state
            env.sync()
            return y

        systems["torch_eager"] = eager
        if env.cuda:
            def graphed():
                y = torch_graph(x_t)
                env.sync()
                return y
            systems["torch_graph_per_shape"] = graphed
        for system, fn in systems.items():
            try:
                y = fn()
                got = y.numpy() if hasattr(y, "numpy") and not hasattr(y, "detach") else y.detach().cpu().numpy()
                diff = float(np.abs(got - want_np).max())
                err[system] = max(err.get(system, 0.0), diff)
                rel_err[system] = max(rel_err.get(system, 0.0),
                                      diff / float(np.abs(want_np).max()))
                latency.setdefault(system, {})[key] = _median_us(fn, reps, warmup=1) / 1e3
            except Exception as error:  # pylint: disable=broad-except
                notes[system] = _error(error)
        print(f"  {key:>5s} s: " + " ".join(f"{s}={latency[s][key]:.2f}" for s in latency
                                            if key in latency[s]) + " ms", flush=True)
    grape.close()
    notes.setdefault("torch_compiled", "not run: a compiled graph per audio length")
    return {"status": "ok", "artifact": grape_path.name, "latency_ms": latency,
            "max_abs_err_vs_torch_eager": err, "max_rel_err_vs_torch_eager": rel_err,
            "samples": lengths, "notes": notes,
            "model": f"Wav2Vec2 ({model.config.num_hidden_layers} layers, hidden "
                     f"{model.config.hidden_size}), fp32, batch 1"}


# -- output ----------------------------------------------------------------------------------

def _print_series(title: str, prefix: str, lengths: list[str], series_by_row: dict) -> None:
    print(f"\n{title:25s}" + " ".join(f"{prefix + n:>9s}" for n in lengths))
    for row, series in series_by_row.items():
        print(f"  {row:22s} " + " ".join(
            f"{series[n]:9.0f}" if n in series else f"{'-':>9s}" for n in lengths))


def print_tables(result: dict) -> None:
    gpt2 = result.get("gpt2", {})
    steps = gpt2.get("decode_step_us", {})
    if steps:
        rows = dict(steps)
        if gpt2.get("gpu_busy_us"):
            rows["grape gpu_busy (floor)"] = gpt2["gpu_busy_us"]
        _print_series("GPT-2 decode step (us)", "L=", [str(n) for n in gpt2["past_lengths"]], rows)
    if gpt2.get("prefill_us"):
        _print_series("GPT-2 prefill (us)", "S=", [str(n) for n in gpt2["prefill_lengths"]],
                      gpt2["prefill_us"])
    if gpt2.get("tokens_per_s"):
        print("\nGPT-2 greedy generation (tokens/s, tokens equal torch_eager's)")
        for system, rate in gpt2["tokens_per_s"].items():
            same = gpt2["generation"]["tokens_identical"].get(system)
            print(f"  {system:22s} {rate:9.1f}   identical={same}")
        print(f"  torch_compiled: {gpt2.get('torch_compiled_mode')}")
    if gpt2.get("graph_memory_bytes"):
        print("\nGraph memory after the generation (bytes): " + ", ".join(
            f"{k}={v}" for k, v in gpt2["graph_memory_bytes"].items()))
    w2v = result.get("wav2vec2", {})
    if w2v.get("latency_ms"):
        keys = [f"{n / SAMPLE_RATE:g}" for n in w2v["samples"]]
        print("\nWav2Vec2 latency (ms)    " + " ".join(f"{k + ' s':>9s}" for k in keys))
        for system, series in w2v["latency_ms"].items():
            print(f"  {system:22s} " + " ".join(
                f"{series[k]:9.2f}" if k in series else f"{'-':>9s}" for k in keys))
        rel = w2v.get("max_rel_err_vs_torch_eager", {})
        print("  max |y - eager's| / max |eager's|: " +
              ", ".join(f"{s} {e:.1e}" for s, e in rel.items() if s != "torch_eager"))
    elif w2v:
        print(f"\nWav2Vec2: {w2v.get('status')}: {w2v.get('reason', '')}")


def _log_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    gpt2, w2v = result.get("gpt2", {}), result.get("wav2vec2", {})
    panels = 3 if w2v.get("latency_ms") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax = axes[0]
    for system, series in gpt2.get("decode_step_us", {}).items():
        ns = sorted(int(n) for n in series)
        ax.plot(ns, [series[str(n)] for n in ns], marker="o", ms=4, label=system)
    busy = gpt2.get("gpu_busy_us") or {}
    if busy:
        ns = sorted(int(n) for n in busy)
        ax.plot(ns, [busy[str(n)] for n in ns], "k--", label="grape GPU busy (floor)")
    _log_axes(ax, "past length (tokens in the KV cache)", "decode step, batch 1 (us)",
              "GPT-2 decode step")
    ax = axes[1]
    rates = gpt2.get("tokens_per_s", {})
    ax.bar(range(len(rates)), list(rates.values()),
           color=["C2" if gpt2["generation"]["tokens_identical"].get(s) else "C3" for s in rates])
    ax.set_xticks(range(len(rates)), list(rates), rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (green: tokens equal PyTorch eager's)")
    ax.set_title(f"GPT-2 greedy, prompt {gpt2.get('prompt_len')}, {gpt2.get('max_new_tokens')} new")
    if panels == 3:
        ax = axes[2]
        for system, series in w2v["latency_ms"].items():
            xs = sorted(float(k) for k in series)
            ax.plot(xs, [series[f"{x:g}"] for x in xs], marker="o", ms=4, label=system)
        _log_axes(ax, "audio (s)", "latency (ms)", "Wav2Vec2")
    fig.suptitle(result["machine"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- CPU development -------------------------------------------------------------------------

def build_dev_artifacts(out: Path, dtype: str = "float32") -> None:
    """Tiny GPT-2 (and Wav2Vec2, in fp32) for llvm, grape and TVM's VM: the CPU dev run's
    artifacts."""
    import tvm  # pylint: disable=import-outside-toplevel

    import grape_tvm  # pylint: disable=import-outside-toplevel
    from export_hf import export_all  # pylint: disable=import-outside-toplevel
    from grape_tvm.compiler import package  # pylint: disable=import-outside-toplevel
    from grape_tvm.frontend import import_onnx, load_onnx, onnx_signature  # pylint: disable=import-outside-toplevel

    fp16 = "_fp16" if dtype == "float16" else ""
    dims = {f"gpt2_prefill{fp16}_tiny": {"batch": (1, 2), "seq": (1, 128)},
            f"gpt2_decode{fp16}_tiny": {"batch": (1, 2), "past": (1, 128)}}
    if not fp16:
        dims["wav2vec2_tiny"] = {"batch": (1, 1), "samples": (400, 4000)}
    out.mkdir(parents=True, exist_ok=True)
    export_all(out / "onnx", tiny=True, embed_weights=False, dtype=dtype,
               models=("gpt2",) if fp16 else ("gpt2", "wav2vec2"))
    for name, declared in dims.items():
        onnx_path = out / "onnx" / f"{name}.onnx"
        grape_tvm.compile_onnx(onnx_path, dims=declared).export(out / f"{name}.llvm.grape")
        (out / f"{name}.weights.json").write_bytes((out / "onnx" / f"{name}.weights.json").read_bytes())
        proto = load_onnx(onnx_path)
        signature = onnx_signature(proto, declared)
        mod = import_onnx(proto, signature.dims)
        mod["main"] = mod["main"].with_attr("tir_var_upper_bound",
                                            {k: v.hi for k, v in signature.dims.items()})
        vm = tvm.compile(mod, target="llvm")
        package(vm, signature, "llvm").export(out / f"{name}.tvm_vm.llvm.grape")
        print(f"{name}: built", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", type=Path, default=Path("build/gpu"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--reps", type=int, default=10, help="timed calls per decode step/length")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--gen-runs", type=int, default=3, help="timed generations per system")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--no-busy", action="store_true", help="skip the GPU-busy floor")
    parser.add_argument("--skip", default="", help="comma list: gpt2,wav2vec2")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="the tiny models (CPU development)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="GPT-2's dtype (float16: no Wav2Vec2; results in models_fp16.json)")
    parser.add_argument("--build-dev", type=Path, default=None,
                        help="build tiny llvm artifacts into this folder first and use them "
                             "(needs the TVM compiler)")
    args = parser.parse_args()
    if args.build_dev is not None:
        build_dev_artifacts(args.build_dev, args.dtype)
        args.artifacts = args.build_dev
    env = Env(args.artifacts, args.device, args.tiny, args.dtype)
    torch = env.torch
    machine = (f"{torch.cuda.get_device_name(0)}" if env.cuda else "CPU") + \
        f", torch {torch.__version__}, tvm {env.tvm.__version__}"
    try:
        import transformers  # pylint: disable=import-outside-toplevel
        machine += f", transformers {transformers.__version__}"
    except ImportError:
        pass
    skip = set(filter(None, args.skip.split(",")))
    if args.dtype != "float32":
        skip.add("wav2vec2")  # exported in fp32 only
    stem = "models" if args.dtype == "float32" else "models_fp16"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
    result = {"machine": machine, "tf32": tf32,
              "command": "python3 -P bench/hf_models.py " + " ".join(sys.argv[1:]) +
                         " (bash bench/gpu/run_all.sh runs it with --artifacts build/gpu --out $OUT)"}
    t0 = time.perf_counter()
    if "gpt2" not in skip:
        try:
            result["gpt2"] = run_gpt2(env, args)
        except Exception as err:  # pylint: disable=broad-except
            traceback.print_exc()
            result["gpt2"] = {"status": "failed", "reason": _error(err)}
    if "wav2vec2" not in skip:
        try:
            result["wav2vec2"] = run_wav2vec2(env, args)
        except Exception as err:  # pylint: disable=broad-except
            traceback.print_exc()
            result["wav2vec2"] = {"status": "failed", "reason": _error(err), "latency_ms": {}}
    result["wall_s"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    print_tables(result)
    try:
        plot(result, args.out / f"{stem}.png")
    except Exception as err:  # pylint: disable=broad-except
        print(f"plot failed: {_error(err)}", flush=True)
    print(f"wrote {args.out / (stem + '.json')} in {result['wall_s']:.0f} s", flush=True)
    failed = [k for k in ("gpt2", "wav2vec2") if result.get(k, {}).get("status") == "failed"]
    if failed:
        sys.exit(f"failed: {failed}")


if __name__ == "__main__":
    main()
