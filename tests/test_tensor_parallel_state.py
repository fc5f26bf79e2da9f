"""State that stays on the ranks of a ``TensorParallelSession`` (threaded disco workers on
the CPU, conftest's numpy stand-ins for its collectives): a GPT-2 decode step's caches kept
on the ranks between calls (``run(feed_back=...)``) equal the one-device step's at several
cache lengths, each call sending only the new token; and a step annotated for N devices,
compiled as a loop (``compile_loop(..., tensor_parallel=N)``), run on every rank
(``run_loop``), equals the one-device loop: same steps, same final state. A process session
only loads here (its loop runners made in every worker): its calls need collectives across
processes, which this CPU machine has none of."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import grape_tvm
from grape_tvm.passes.tensor_parallel import shard, with_mesh
from grape_tvm.runtime.signature import InputError
from grape_tvm.tensor_parallel_session import TensorParallelSession

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from models import (gelu_numpy, gpt2_decode_step, gpt2_numpy,  # noqa: E402  pylint: disable=wrong-import-position
                    gpt2_output_names, gpt2_qkv_by_ranks, gpt2_shapes)

HIDDEN, HEADS, LAYERS = 64, 4, 2
D = HIDDEN // HEADS
PAST_MAX = 32
CACHES = [f"past_{kv}{i}" for i in range(LAYERS) for kv in ("k", "v")]
KEEP_CACHES = {f"present_{name[5:]}": name for name in CACHES}  # present_k0 -> past_k0


@pytest.fixture(scope="module")
def decode_artifacts(tmp_path_factory):
    """The GPT-2 decode step built for ``world`` ranks (made once per world)."""
    built: dict[int, Path] = {}

    def artifact(world: int) -> Path:
        if world not in built:
            module = grape_tvm.build(gpt2_decode_step(HIDDEN, HEADS, LAYERS, tensor_parallel=world),
                                     {"past": (1, PAST_MAX)}, "llvm", tensor_parallel=world,
                                     output_names=gpt2_output_names(LAYERS))
            built[world] = module.export(tmp_path_factory.mktemp("tp") / f"step{world}.grape")
        return built[world]

    return artifact


@pytest.fixture(scope="module")
def decode_weights():
    rng = np.random.default_rng(5)
    return {k: (0.1 * rng.standard_normal(s)).astype("float32")
            for k, s in gpt2_shapes(HIDDEN, LAYERS).items()}


def _session(path: Path, world: int, weights: dict) -> TensorParallelSession:
    ranks = TensorParallelSession(path, threaded=True, ccl=None)
    ranks.bind_inputs(gpt2_qkv_by_ranks(weights, HEADS, world))
    return ranks


def _random_caches(rng, length: int) -> list[np.ndarray]:
    return [rng.standard_normal((HEADS, length, D)).astype("float32") for _ in CACHES]


def _sent(monkeypatch, session) -> list[tuple[int, ...]]:
    """The shapes of every array the controller sends to the ranks from now on."""
    sent: list[tuple[int, ...]] = []
    cls = type(session)
    for method in ("broadcast", "scatter"):
        original = getattr(cls, method)

        def recording(self, value, *args, _original=original, **kwargs):
            sent.append(tuple(np.shape(value)))
            return _original(self, value, *args, **kwargs)

        monkeypatch.setattr(cls, method, recording)
    return sent


@pytest.mark.parametrize("world", [2, 4])
def test_caches_kept_on_the_ranks_equal_one_device(world, decode_artifacts, decode_weights,
                                                   disco_collectives, monkeypatch):
    """From caches of 1, 9 and 26 tokens, four decode steps each: the first call passes the
    caches whole (replacing what the steps before kept), the next ones only ``x``; every
    call returns ``y`` alone, equal to the numpy reference, and keeps caches one token
    longer on the ranks; the last call gathers them too (``gather``), equal to the
    reference's. After the first call of each run, no cache leaves the controller."""
    disco_collectives(world)
    rng = np.random.default_rng(world)
    with _session(decode_artifacts(world), world, decode_weights) as ranks:
        sent = _sent(monkeypatch, ranks.session)
        for start in (1, 9, 26):
            caches = _random_caches(rng, start)
            given = dict(zip(CACHES, caches))
            for step in range(4):
                x = rng.standard_normal((1, HIDDEN)).astype("float32")
                last = step == 3
                sent.clear()
                got = ranks.run({"x": x, **given}, feed_back=KEEP_CACHES,
                                gather=KEEP_CACHES if last else ())
                y, caches = gpt2_numpy(x, caches, decode_weights, HEADS, LAYERS)
                assert sorted(got) == sorted(["y", *KEEP_CACHES] if last else ["y"])
                np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
                if given:  # x and the caches
                    assert len(sent) == 1 + len(CACHES)
                else:  # x alone: the caches are where they were made
                    assert sent == [(1, HIDDEN)]
                assert ranks.kept == dict.fromkeys(CACHES, (HEADS, start + step + 1, D))
                given = {}
            for name, cache in zip(KEEP_CACHES, caches):
                np.testing.assert_allclose(got[name], cache, rtol=1e-5, atol=1e-5)


def test_outputs_held_whole_are_kept_too(decode_artifacts, decode_weights, disco_collectives):
    """``y``, which every rank holds whole, kept as the next call's ``x``: calls with no
    input at all run the model on its own output, as the reference does."""
    disco_collectives(2)
    rng = np.random.default_rng(11)
    caches = _random_caches(rng, 5)
    x = rng.standard_normal((1, HIDDEN)).astype("float32")
    keep = {"y": "x", **KEEP_CACHES}
    with _session(decode_artifacts(2), 2, decode_weights) as ranks:
        ranks.run({"x": x, **dict(zip(CACHES, caches))}, feed_back=keep)
        x, caches = gpt2_numpy(x, caches, decode_weights, HEADS, LAYERS)
        for _ in range(3):
            assert ranks.run({}, feed_back=keep) == {}
            x, caches = gpt2_numpy(x, caches, decode_weights, HEADS, LAYERS)
        got = ranks.run({}, gather=["y"])  # kept nothing: every output comes back
        y, presents = gpt2_numpy(x, caches, decode_weights, HEADS, LAYERS)
        np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
        for name, present in zip(KEEP_CACHES, presents):
            np.testing.assert_allclose(got[name], present, rtol=1e-5, atol=1e-5)
        assert ranks.kept == {}


def test_feed_back_refuses_what_cannot_be_its_input(decode_artifacts, decode_weights,
                                                    disco_collectives):
    """Names the model does not have, a bound input, an input named twice, another rank or
    static size: refused before the call, which does not run. A ``feed_back`` accepted
    once is refused after its input is bound (the check is not kept past ``bind_inputs``)."""
    disco_collectives(2)
    caches = dict(zip(CACHES, _random_caches(np.random.default_rng(0), 3)))
    inputs = {"x": np.zeros((1, HIDDEN), "float32"), **caches}
    with _session(decode_artifacts(2), 2, decode_weights) as ranks:
        for feed_back, message in [({"nope": "past_k0"}, r"output\(s\) \['nope'\] are not"),
                                   ({"present_k0": "nope"}, r"input\(s\) \['nope'\], which"),
                                   ({"y": "ln1_g0"}, "not bound"),
                                   ({"present_k0": "past_k0", "present_k1": "past_k0"},
                                    "must be distinct"),
                                   ({"y": "past_k0"}, "'y' .* cannot be input 'past_k0'"),
                                   ({"present_k0": "x"}, "cannot be input 'x'")]:
            with pytest.raises(InputError, match=message):
                ranks.run(inputs, feed_back=feed_back)
        with pytest.raises(InputError, match=r"output\(s\) \['nope'\] are not"):
            ranks.run(inputs, gather=["nope"])
        assert ranks.kept == {}
        keep = {"present_k0": "past_k0"}
        ranks.run(inputs, feed_back=keep)
        ranks.drop_kept()
        ranks.bind_inputs({"past_k0": caches["past_k0"]})
        with pytest.raises(InputError, match="not bound"):
            ranks.run({k: v for k, v in inputs.items() if k != "past_k0"}, feed_back=keep)


def test_kept_inputs_are_checked_with_the_next_calls_inputs(decode_artifacts, decode_weights,
                                                            disco_collectives):
    """A kept cache is checked as a given one is, before anything is sent: one that grew
    past the declared range, or whose length differs from a cache given beside it, raises
    ``InputError`` naming it, and the kept caches stay as they were (the next call reads
    them, equal to the reference). Binding a kept input is refused; ``drop_kept`` lets them
    go, after which the caches must be given."""
    disco_collectives(2)
    rng = np.random.default_rng(2)
    with _session(decode_artifacts(2), 2, decode_weights) as ranks:
        caches = _random_caches(rng, 6)
        x = rng.standard_normal((1, HIDDEN)).astype("float32")
        ranks.run({"x": x, **dict(zip(CACHES, caches))}, feed_back=KEEP_CACHES)
        _, caches = gpt2_numpy(x, caches, decode_weights, HEADS, LAYERS)
        with pytest.raises(InputError, match="'past'.* is 7, but another input set 'past' to 5"):
            ranks.run({"x": x, "past_k0": caches[0][:, :5]}, feed_back=KEEP_CACHES)
        with pytest.raises(InputError, match="drop_kept"):
            ranks.bind_inputs({"past_v1": caches[3]})
        got = ranks.run({"x": x}, feed_back=KEEP_CACHES, gather=["present_v1"])
        y, caches = gpt2_numpy(x, caches, decode_weights, HEADS, LAYERS)
        np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["present_v1"], caches[3], rtol=1e-5, atol=1e-5)

        full = _random_caches(rng, PAST_MAX)  # the next call's outputs are one longer
        ranks.run({"x": x, **dict(zip(CACHES, full))}, feed_back=KEEP_CACHES)
        with pytest.raises(InputError, match="input 'past_k0' axis 1 .* is 33, outside"):
            ranks.run({"x": x}, feed_back=KEEP_CACHES)
        assert set(ranks.kept) == set(CACHES)
        with pytest.raises(KeyError, match=r"no output is kept for input\(s\) \['x'\]"):
            ranks.drop_kept([CACHES[0], "x"])
        assert set(ranks.kept) == set(CACHES)  # none dropped
        ranks.drop_kept(CACHES[:1])
        assert sorted(ranks.kept) == sorted(CACHES[1:])
        ranks.drop_kept()
        assert ranks.kept == {}
        with pytest.raises(InputError, match="missing input"):
            ranks.run({"x": x})
    assert ranks.kept == {}


# -- the loop on every rank ---------------------------------------------------------------
LOOP_HIDDEN, LOOP_HEADS, MAX_LEN, MAX_STEPS = 32, 4, 12, 10
LOOP_D = LOOP_HIDDEN // LOOP_HEADS
CARRIED = ["h", "pos", "k", "v"]
LOOP_WEIGHTS = {"ln_g": (LOOP_HIDDEN,), "ln_b": (LOOP_HIDDEN,),
                "w_qkv": (LOOP_HIDDEN, 3 * LOOP_HIDDEN), "b_qkv": (3 * LOOP_HIDDEN,),
                "w_o": (LOOP_HIDDEN, LOOP_HIDDEN), "b_o": (LOOP_HIDDEN,),
                "w_fc": (LOOP_HIDDEN, 4 * LOOP_HIDDEN), "b_fc": (4 * LOOP_HIDDEN,),
                "w_proj": (4 * LOOP_HIDDEN, LOOP_HIDDEN), "b_proj": (LOOP_HIDDEN,)}


def loop_step(world: int, split: str | None = None) -> tvm.IRModule:
    """One step of an attention and MLP layer with a fixed-capacity cache, annotated for
    ``world`` devices as ``gpt2_decode_step`` is (heads and the MLP's columns split):
    state ``h`` (1, hidden), ``pos`` (1,) int32, ``k``/``v`` (heads, max_len, d), written at
    ``pos``; ``stop`` (1,) int32 once max|h| passes ``threshold`` (computed from the
    replicated ``h``). ``split`` ("h" or "stop"), for the refusals: that output made of
    attention's merged heads instead, which each rank holds its columns of."""
    op = relax.op
    f32 = "float32"
    state = {"h": relax.Var("h", relax.TensorType((1, LOOP_HIDDEN), f32)),
             "pos": relax.Var("pos", relax.TensorType((1,), "int32"))}
    for name in ("k", "v"):
        state[name] = relax.Var(name, relax.TensorType((LOOP_HEADS, MAX_LEN, LOOP_D), f32))
    w = {k: relax.Var(k, relax.TensorType(s, f32)) for k, s in LOOP_WEIGHTS.items()}
    threshold = relax.Var("threshold", relax.TensorType((1,), f32))
    # 0..max_len-1 and 1 as inputs: a sharded build leaves tensor constants typed for the
    # mesh, which the lowering after it refuses (TVM 0.27).
    positions = relax.Var("positions", relax.TensorType((MAX_LEN,), "int32"))
    one = relax.Var("one", relax.TensorType((1,), "int32"))
    bb = relax.BlockBuilder()

    def placed(value, placement):
        return bb.emit(value) if world == 1 else shard(bb, bb.emit(value), placement, world)

    with bb.function("main", [*state.values(), threshold, positions, one, *w.values()]):
        with bb.dataflow():
            h, pos = state["h"], state["pos"]
            ln = bb.emit(op.nn.layer_norm(h, w["ln_g"], w["ln_b"], axes=[-1], epsilon=1e-5))
            qkv = bb.emit(op.add(op.matmul(ln, w["w_qkv"]), w["b_qkv"]))
            if world == 1:
                parts = [op.strided_slice(qkv, axes=[1], begin=[j * LOOP_HIDDEN],
                                          end=[(j + 1) * LOOP_HIDDEN]) for j in range(3)]
            else:  # the columns in rank order (gpt2_qkv_by_ranks)
                by_rank = bb.emit(op.reshape(shard(bb, qkv, "S[1]", world), (
                    1, world, 3, LOOP_HEADS // world, LOOP_D)))
                parts = [op.strided_slice(by_rank, axes=[2], begin=[j], end=[j + 1])
                         for j in range(3)]
            q, k, v = [placed(op.permute_dims(op.reshape(part, (1, LOOP_HEADS, LOOP_D)),
                                              [1, 0, 2]), "S[0]") for part in parts]
            at = bb.emit(op.reshape(op.equal(positions, pos), (1, MAX_LEN, 1)))
            k_next = placed(op.where(at, k, state["k"]), "S[0]")  # written at pos
            v_next = placed(op.where(at, v, state["v"]), "S[0]")
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k_next, [0, 2, 1])),
                                         relax.const(1.0 / LOOP_D ** 0.5, f32)))
            hidden = op.multiply(op.astype(op.greater(positions, pos), f32),
                                 relax.const(-1e30, f32))  # the positions not written yet
            scores = bb.emit(op.add(scores, hidden))  # (heads, 1, max_len)
            attn = bb.emit(op.matmul(op.nn.softmax(scores, axis=-1), v_next))
            merged = bb.emit(op.reshape(op.permute_dims(attn, [1, 0, 2]), (1, LOOP_HIDDEN)))
            out = placed(op.matmul(merged, w["w_o"]), "R")
            h = bb.emit(op.add(h, op.add(out, w["b_o"])))
            fc = placed(op.nn.gelu(op.add(op.matmul(h, w["w_fc"]), w["b_fc"])), "S[1]")
            proj = placed(op.matmul(fc, w["w_proj"]), "R")
            h_next = bb.emit(op.add(h, op.add(proj, w["b_proj"])))
            passed = op.reshape(op.greater(op.max(op.abs(h_next)), threshold), (1,))
            stop = bb.emit(op.astype(passed, "int32"))
            if split == "h":
                h_next = placed(op.add(merged, merged), "S[1]")
            elif split == "stop":
                stop = placed(op.astype(op.greater(merged, threshold), "int32"), "S[1]")
            pos_next = bb.emit(op.add(pos, one))
            result = bb.emit_output(relax.Tuple([h_next, pos_next, k_next, v_next, stop]))
        bb.emit_func_output(result)
    mod = bb.get()
    return with_mesh(mod, world) if world > 1 else mod


def loop_numpy_step(state: dict, weights: dict) -> dict:
    """``loop_step`` in numpy (float64): the next state, to check the one-device loop."""
    def ln(x):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * \
            weights["ln_g"] + weights["ln_b"]

    h, pos = state["h"].astype(np.float64), int(state["pos"][0])
    qkv = ln(h) @ weights["w_qkv"] + weights["b_qkv"]
    q, k, v = [qkv[:, j * LOOP_HIDDEN:(j + 1) * LOOP_HIDDEN].reshape(LOOP_HEADS, 1, LOOP_D)
               for j in range(3)]
    kc, vc = state["k"].copy(), state["v"].copy()
    kc[:, pos:pos + 1], vc[:, pos:pos + 1] = k, v
    s = (q @ kc.transpose(0, 2, 1) / np.sqrt(LOOP_D))[:, :, :pos + 1]
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    h = h + (p @ vc[:, :pos + 1]).transpose(1, 0, 2).reshape(1, LOOP_HIDDEN) @ weights["w_o"] + \
        weights["b_o"]
    h = h + gelu_numpy(h @ weights["w_fc"] + weights["b_fc"]) @ weights["w_proj"] + weights["b_proj"]
    return {"h": h.astype(np.float32), "pos": np.array([pos + 1], np.int32),
            "k": kc.astype(np.float32), "v": vc.astype(np.float32)}


@pytest.fixture(scope="module")
def loop_weights():
    rng = np.random.default_rng(8)
    return {k: (0.3 * rng.standard_normal(s)).astype("float32") for k, s in LOOP_WEIGHTS.items()}


@pytest.fixture(scope="module")
def loop_artifacts(tmp_path_factory):
    """``loop_step`` compiled as a loop for ``world`` devices (1: the one-device loop)."""
    built: dict[int, Path] = {}

    def artifact(world: int) -> Path:
        if world not in built:
            module = grape_tvm.compile_loop(loop_step(world), CARRIED, max_steps=MAX_STEPS,
                                            target="llvm", tensor_parallel=world)
            built[world] = module.export(tmp_path_factory.mktemp("loop") / f"loop{world}.grape")
        return built[world]

    return artifact


def _initial_state() -> dict:
    rng = np.random.default_rng(4)
    return {"h": rng.standard_normal((1, LOOP_HIDDEN)).astype("float32"),
            "pos": np.zeros((1,), np.int32),
            "k": np.zeros((LOOP_HEADS, MAX_LEN, LOOP_D), np.float32),
            "v": np.zeros((LOOP_HEADS, MAX_LEN, LOOP_D), np.float32)}


def _invariants(threshold: float) -> dict:
    return {"threshold": np.array([threshold], np.float32),
            "positions": np.arange(MAX_LEN, dtype=np.int32), "one": np.ones(1, np.int32)}


def _stopping_threshold(weights: dict) -> tuple[float, int]:
    """A threshold the loop passes first at a step below the limit, with a margin either
    side (the ranks' sums differ from one device's in the last bits), and that step."""
    state, peaks = _initial_state(), []
    for _ in range(MAX_STEPS):
        state = loop_numpy_step(state, weights)
        peaks.append(float(np.abs(state["h"]).max()))
    for step in range(2, MAX_STEPS - 1):  # a new peak: max|h| first passes below it there
        before = max(peaks[:step])
        if peaks[step] > 1.01 * before:
            return (before + peaks[step]) / 2, step + 1
    raise AssertionError(f"no step passes the peaks before it: {peaks}")


def _one_device_loop(path: Path, weights: dict, threshold: float, max_steps=None):
    with grape_tvm.load_loop(path, "cpu") as loop:
        loop.bind_inputs({**_invariants(threshold), **weights})
        result = loop.run(_initial_state(), max_steps)
        return {k: v.numpy() for k, v in result.state.items()}, result.steps


@pytest.mark.parametrize("world", [2, 4])
def test_the_loop_on_every_rank_equals_the_one_device_loop(world, loop_artifacts, loop_weights,
                                                           disco_collectives):
    """To the step limit, stopped early by the replicated flag, and by a smaller
    ``max_steps``: the same steps as the one-device loop, and the same final state (the
    caches gathered from the ranks, whole). The one-device loop is checked against numpy."""
    disco_collectives(world)
    early, early_steps = _stopping_threshold(loop_weights)
    want = {}
    for threshold, max_steps in ((1e30, None), (early, None), (1e30, 3)):
        want[threshold, max_steps] = _one_device_loop(loop_artifacts(1), loop_weights, threshold,
                                                      max_steps)
    reference = _initial_state()
    for _ in range(MAX_STEPS):
        reference = loop_numpy_step(reference, loop_weights)
    for name, value in want[1e30, None][0].items():
        np.testing.assert_allclose(value, reference[name], rtol=1e-4, atol=1e-4)
    assert [steps for _, steps in want.values()] == [MAX_STEPS, early_steps, 3]

    ordered = gpt2_qkv_by_ranks(loop_weights, LOOP_HEADS, world)
    with TensorParallelSession(loop_artifacts(world), threaded=True, ccl=None) as ranks:
        assert ranks.loop_spec.carried == tuple(CARRIED)
        for (threshold, max_steps), (state, steps) in want.items():
            ranks.bind_inputs({**_invariants(threshold), **ordered})
            got = ranks.run_loop(_initial_state(), max_steps)
            assert got.steps == steps
            assert sorted(got.state) == sorted(CARRIED)
            for name, value in state.items():
                np.testing.assert_allclose(got.state[name], value, rtol=1e-4, atol=1e-4)


def test_compile_loop_refuses_a_step_the_ranks_cannot_loop():
    """A stop flag split across the ranks (each would stop on its own part), and carried
    state taken whole but returned split, are refused."""
    with pytest.raises(ValueError, match="stop 'stop' is split across the ranks"):
        grape_tvm.compile_loop(loop_step(2, split="stop"), CARRIED,
                               max_steps=4, tensor_parallel=2)
    with pytest.raises(ValueError, match="carried 'h' is taken whole and its next value comes "
                                         "out split along axis 1"):
        grape_tvm.compile_loop(loop_step(2, split="h"), CARRIED, max_steps=4,
                               tensor_parallel=2)


def test_run_loop_refusals(loop_artifacts, decode_artifacts, loop_weights, disco_collectives):
    """A state that is not the carried one, an unbound invariant, outputs kept from a call
    (the loop's steps would write over them), and a step artifact with no loop."""
    disco_collectives(2)
    with TensorParallelSession(loop_artifacts(2), threaded=True, ccl=None) as ranks:
        with pytest.raises(InputError, match="missing input"):
            ranks.run_loop(_initial_state())  # threshold and the weights not bound
        ranks.bind_inputs({**_invariants(1e30), **gpt2_qkv_by_ranks(loop_weights, LOOP_HEADS, 2)})
        with pytest.raises(InputError, match="the loop state is"):
            ranks.run_loop({k: v for k, v in _initial_state().items() if k != "pos"})
        ranks.run(_initial_state(), feed_back={"k": "k"})
        with pytest.raises(InputError, match="drop_kept"):
            ranks.run_loop(_initial_state())
        ranks.drop_kept()
        assert ranks.run_loop(_initial_state(), 2).steps == 2
    with TensorParallelSession(decode_artifacts(2), threaded=True, ccl=None) as ranks:
        with pytest.raises(ValueError, match="not compiled by compile_loop"):
            ranks.run_loop({})


_PROCESS_LOOP_SESSION = """
import sys
from grape_tvm.tensor_parallel_session import TensorParallelSession
with TensorParallelSession(sys.argv[1], ccl=None) as ranks:
    print(",".join(ranks.loop_spec.carried))
print("closed")
"""


def test_a_process_session_makes_the_loop_on_every_worker(loop_artifacts):
    """A ``ProcessSession`` of a loop artifact: every worker process makes its loop runner
    (the session checks each) and the session closes cleanly, the runners first. Its loop
    does not run here: that needs collectives across processes, which this CPU machine has
    none of."""
    import subprocess  # pylint: disable=import-outside-toplevel

    done = subprocess.run([sys.executable, "-c", _PROCESS_LOOP_SESSION, str(loop_artifacts(2))],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == [",".join(CARRIED), "closed"]
