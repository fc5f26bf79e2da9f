"""The Llama decode step of tensor parallelism's GPU benchmark (``bench/models.py``:
``llama_decode_step``) at a tiny configuration, float32 on the CPU: one device equals the
numpy reference (float64) at several batch sizes and cache lengths; built for 2 and 4
devices, it is split Megatron's way (q/k/v, gate and up by columns, the caches by heads,
two all-reduces a layer, each a kernel of the one graph region) and a threaded session of
that many ranks (conftest's numpy stand-ins for disco's collectives) equals one device over
decode steps whose caches stay on the ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import grape_tvm
from grape_tvm.artifact import Artifact
from grape_tvm.tensor_parallel_session import TensorParallelSession

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from models import (LLAMA_TINY, llama_cache_names, llama_decode_step,  # noqa: E402  pylint: disable=wrong-import-position
                    llama_numpy, llama_output_names, llama_rotary, llama_weights)

CONFIG = LLAMA_TINY
DIMS = {"batch": (1, 8), "past": (1, 32)}
CACHES = llama_cache_names(CONFIG.layers)
KEEP_CACHES = {f"present_{name[5:]}": name for name in CACHES}  # present_k0 -> past_k0


@pytest.fixture(scope="module")
def llama_artifacts(tmp_path_factory):
    """The tiny Llama step built for ``world`` devices (1: a plain build), once each."""
    built: dict[int, Path] = {}

    def artifact(world: int) -> Path:
        if world not in built:
            module = grape_tvm.build(llama_decode_step(CONFIG, world, "float32"), DIMS, "llvm",
                                     tensor_parallel=world,
                                     output_names=llama_output_names(CONFIG.layers))
            built[world] = module.export(tmp_path_factory.mktemp("llama") / f"step{world}.grape")
        return built[world]

    return artifact


@pytest.fixture(scope="module")
def weights():
    return llama_weights(CONFIG, seed=3)


def _token(rng, batch: int, position: int) -> dict[str, np.ndarray]:
    """A new token's inputs: its embedding and the rotary tables of its position."""
    cos, sin = llama_rotary(CONFIG, [position] * batch)
    return {"x": rng.standard_normal((batch, CONFIG.hidden)).astype("float32"),
            "cos": cos, "sin": sin}


def _caches(rng, batch: int, length: int) -> dict[str, np.ndarray]:
    shape = (batch, CONFIG.heads, length, CONFIG.head_dim)
    return {name: rng.standard_normal(shape).astype("float32") for name in CACHES}


@pytest.mark.parametrize("batch,past", [(1, 1), (3, 7), (8, 32)])
def test_one_device_equals_numpy(batch, past, llama_artifacts, weights):
    """Logits and every present, at the smallest and largest declared batch and cache."""
    rng = np.random.default_rng(batch * 100 + past)
    token, caches = _token(rng, batch, past), _caches(rng, batch, past)
    with grape_tvm.load(llama_artifacts(1), "cpu") as executor:
        executor.bind_inputs(weights)
        got = executor.run({**token, **caches})
    logits, presents = llama_numpy(token["x"], token["cos"], token["sin"], list(caches.values()),
                                   weights, CONFIG)
    assert list(got) == llama_output_names(CONFIG.layers)
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-4, atol=1e-4)
    for name, present in zip(KEEP_CACHES, presents):
        assert got[name].shape == (batch, CONFIG.heads, past + 1, CONFIG.head_dim)
        np.testing.assert_allclose(got[name], present, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("world", [2, 4])
def test_split_megatrons_way(world, llama_artifacts):
    """The shard plan: q/k/v, gate and up by columns, wo and down by rows, the caches (in
    and out) by heads, the norms and the LM head whole; two all-reduces a layer (after wo
    and after down), each a kernel of the one graph region, none a host step."""
    plan = Artifact.load(llama_artifacts(world)).manifest["plan"]
    parallel = plan["tensor_parallel"]
    by_rows = {"wo", "w_down"}
    want = {f"{kind}{i}": 0 if kind in by_rows else 1
            for i in range(CONFIG.layers) for kind in ("wq", "wk", "wv", "wo", "w_gate", "w_up",
                                                       "w_down")}
    assert parallel["world_size"] == world
    assert parallel["shard_plan"] == {**want, **dict.fromkeys(CACHES, 1)}
    assert parallel["output_shard_plan"] == dict.fromkeys(KEEP_CACHES, 1)
    kernels = [k for region in plan["regions"] for k in region["kernels"]]
    assert kernels.count("grape.nccl.allreduce_sum") == 2 * CONFIG.layers, kernels
    assert len(plan["regions"]) == 1, [r["kernels"] for r in plan["regions"]]
    host = [step["op"] for step in plan["host_steps"]]
    assert not [op for op in host if "disco" in op or "nccl" in op], host


def _one_device_decode(path: Path, weights: dict, tokens: list[dict], caches: dict) -> list[dict]:
    """Every step's outputs on one device, each step's presents the next step's caches."""
    outputs = []
    with grape_tvm.load(path, "cpu") as executor:
        executor.bind_inputs(weights)
        for token in tokens:
            got = executor.run({**token, **caches})
            caches = {past: got[present] for present, past in KEEP_CACHES.items()}
            outputs.append(got)
    return outputs


@pytest.mark.parametrize("world,batch", [(2, 1), (2, 5), (4, 2)])
def test_ranks_keeping_their_caches_equal_one_device(world, batch, llama_artifacts, weights,
                                                     disco_collectives):
    """Four decode steps from a cache of 6 tokens: the first call passes the caches whole,
    the next ones only the new token (each rank keeps its heads of the caches,
    ``feed_back``); every step's logits, and the caches gathered at the last step, equal
    one device's. One device's logits are checked against numpy too."""
    disco_collectives(world)
    rng = np.random.default_rng(world * 10 + batch)
    start, steps = 6, 4
    caches = _caches(rng, batch, start)
    tokens = [_token(rng, batch, start + step) for step in range(steps)]
    want = _one_device_decode(llama_artifacts(1), weights, tokens, caches)
    logits, _ = llama_numpy(tokens[0]["x"], tokens[0]["cos"], tokens[0]["sin"],
                            list(caches.values()), weights, CONFIG)
    np.testing.assert_allclose(want[0]["logits"], logits, rtol=1e-4, atol=1e-4)

    with TensorParallelSession(llama_artifacts(world), threaded=True, ccl=None) as ranks:
        ranks.bind_inputs(weights)
        given = caches
        for step, token in enumerate(tokens):
            last = step == steps - 1
            got = ranks.run({**token, **given}, feed_back=KEEP_CACHES,
                            gather=KEEP_CACHES if last else ())
            np.testing.assert_allclose(got["logits"], want[step]["logits"], rtol=1e-5, atol=1e-5)
            assert ranks.kept == dict.fromkeys(
                CACHES, (batch, CONFIG.heads, start + step + 1, CONFIG.head_dim))
            given = {}
        for name in KEEP_CACHES:
            np.testing.assert_allclose(got[name], want[-1][name], rtol=1e-5, atol=1e-5)
