"""compile_loop / load_loop on the CPU: a greedy decoder's loop against TVM's VM.

The reference is a Python loop over TVM's own build of the same step (its default
pipeline), reading the stop flag on the host after each step. grape's loop on the CPU
(``HostLoop``) must give the same tokens and stop at the same step: early (EOS), late
(the step limit) and, for a batch, only once every sequence is done.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import grape_tvm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from models import (  # noqa: E402  pylint: disable=wrong-import-position
    decoder_initial_state,
    decoder_state_names,
    decoder_step,
    decoder_weights,
)

VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN = 64, 32, 2, 2, 24
CARRIED = decoder_state_names(LAYERS)


@pytest.fixture(scope="module")
def step():
    return decoder_step(VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN)


@pytest.fixture(scope="module")
def weights():
    return decoder_weights(VOCAB, HIDDEN, LAYERS, MAX_LEN, seed=3)


@pytest.fixture(scope="module")
def loop_artifact(step, tmp_path_factory):
    module = grape_tvm.compile_loop(step, CARRIED, max_steps=MAX_LEN - 1,
                                    dims={"batch": (1, 4)}, target="llvm")
    return module.export(tmp_path_factory.mktemp("loop") / "decoder.grape")


@pytest.fixture(scope="module")
def reference_vm(step):
    return relax.VirtualMachine(tvm.compile(step, target="llvm"), tvm.cpu())


def vm_loop(vm, state: dict, eos: int, weights: dict, max_steps: int) -> tuple[np.ndarray, int]:
    """TVM's VM, one step per call, stop read on the host: (tokens, steps)."""
    dev = tvm.cpu()
    current = {k: tvm.runtime.tensor(v, dev) for k, v in state.items()}
    fixed = [tvm.runtime.tensor(np.array([eos], np.int32), dev)]
    fixed += [tvm.runtime.tensor(weights[k], dev) for k in weights]
    steps = 0
    while steps < max_steps:
        out = vm["main"](*[current[n] for n in CARRIED], *fixed)
        steps += 1
        current = dict(zip(CARRIED, out[:len(CARRIED)]))
        if out[len(CARRIED)].numpy().any():
            break
    return current["tokens"].numpy(), steps


def grape_loop(artifact, weights: dict, eos: int):
    loop = grape_tvm.load_loop(artifact, "cpu")
    loop.bind_inputs({"eos": np.array([eos], np.int32), **weights})
    return loop


def initial(batch: int) -> dict:
    return decoder_initial_state(batch, HEADS, HIDDEN // HEADS, LAYERS, MAX_LEN)


def test_loop_runs_to_the_step_limit_like_the_vm(loop_artifact, reference_vm, weights):
    eos = VOCAB + 7  # never produced: the step limit stops the loop
    for batch in (1, 3):
        want, want_steps = vm_loop(reference_vm, initial(batch), eos, weights, MAX_LEN - 1)
        with grape_loop(loop_artifact, weights, eos) as loop:
            assert loop.mode == "host"
            got = loop.run(initial(batch))
        assert want_steps == got.steps == MAX_LEN - 1
        np.testing.assert_array_equal(got.state["tokens"].numpy(), want)
        assert len(set(want[0, 1:].tolist())) > 1  # a real sequence, not one token repeated


def test_loop_stops_early_at_eos_like_the_vm(loop_artifact, reference_vm, weights):
    free, _ = vm_loop(reference_vm, initial(1), VOCAB + 7, weights, MAX_LEN - 1)
    # The token first produced at step 4 becomes EOS: the loop must stop right there.
    eos = int(free[0, 4])
    first = 1 + list(free[0, 1:]).index(eos)
    want, want_steps = vm_loop(reference_vm, initial(1), eos, weights, MAX_LEN - 1)
    with grape_loop(loop_artifact, weights, eos) as loop:
        got = loop.run(initial(1))
        tokens = got.state["tokens"].numpy()  # read before the next run at its shape
        limited = loop.run(initial(1), max_steps=2)  # a limit below the stop wins
    assert got.steps == want_steps == first <= 4
    np.testing.assert_array_equal(tokens, want)
    assert limited.steps == 2


def test_a_batch_stops_when_every_sequence_is_done(loop_artifact, reference_vm, weights):
    free, _ = vm_loop(reference_vm, initial(2), VOCAB + 7, weights, MAX_LEN - 1)
    eos = int(free[1, 6])  # sequence 1 produces it at step 6 (or before); sequence 0 may not
    want, want_steps = vm_loop(reference_vm, initial(2), eos, weights, MAX_LEN - 1)
    with grape_loop(loop_artifact, weights, eos) as loop:
        got = loop.run(initial(2))
    assert got.steps == want_steps
    np.testing.assert_array_equal(got.state["tokens"].numpy(), want)
    done = got.state["done"].numpy()
    assert done.all() or got.steps == MAX_LEN - 1
    # After its EOS, a finished sequence only repeats EOS.
    row = want[1, 1:want_steps + 1].tolist()
    assert all(t == eos for t in row[row.index(eos):])


def test_compile_loop_checks_the_step(step):
    with pytest.raises(ValueError, match="not inputs of the step"):
        grape_tvm.compile_loop(step, ["nope", *CARRIED[1:]], max_steps=4)
    with pytest.raises(ValueError, match="returns"):
        grape_tvm.compile_loop(step, CARRIED[:-1], max_steps=4)
    with pytest.raises(ValueError, match="keeps its shape and dtype"):
        grape_tvm.compile_loop(step, [CARRIED[1], CARRIED[0], *CARRIED[2:]], max_steps=4)
    with pytest.raises(ValueError, match="at least 1"):
        grape_tvm.compile_loop(step, CARRIED, max_steps=0)


def test_loop_state_and_loading_errors(loop_artifact, weights, tmp_path):
    with grape_loop(loop_artifact, weights, 0) as loop:
        state = initial(1)
        del state["done"]
        with pytest.raises(ValueError, match=r"missing \['done'\]"):
            loop.run(state)
        with pytest.raises(ValueError, match="at least 1"):
            loop.run(initial(1), max_steps=0)
    with pytest.raises(ValueError, match="needs a CUDA artifact"):
        grape_tvm.load_loop(loop_artifact, "cpu", mode="device")
    plain = grape_tvm.build(decoder_step(VOCAB, HIDDEN, HEADS, LAYERS, MAX_LEN),
                            {"batch": (1, 2)}, "llvm").export(tmp_path / "plain.grape")
    with pytest.raises(ValueError, match="not compiled by compile_loop"):
        grape_tvm.load_loop(plain, "cpu")


def test_inspect_says_how_the_loop_runs(loop_artifact, capsys):
    from grape_tvm.cli import main  # pylint: disable=import-outside-toplevel

    assert main(["inspect", str(loop_artifact), "--json"]) == 0
    loop = json.loads(capsys.readouterr().out)["loop"]
    assert loop["carried"] == CARRIED and loop["stop"] == "stop"
    assert loop["max_steps"] == MAX_LEN - 1 and "host loop" in loop["runs_as"]


def test_device_loop_loads_an_initial_state_once():
    """A host array is copied once into the loop's buffer (counted as h2d), a tensor of the
    caller's once (d2d), and the loop's own buffer passed back not at all; a 0-d value (an
    ONNX Loop's iteration count) stays 0-d. CPU tensors stand in for device ones: the
    copies are the same calls."""
    from grape_tvm.runtime.device_loop import fill_state  # pylint: disable=import-outside-toplevel

    own = tvm.runtime.empty((4,), "float32", tvm.cpu())
    step = tvm.runtime.empty((), "int64", tvm.cpu())
    state = {"a": own, "step": step}
    assert fill_state(state, {"a": np.arange(4, dtype=np.float32), "step": np.array(3)}) == (24, 0)
    np.testing.assert_array_equal(own.numpy(), np.arange(4))
    assert step.numpy() == 3 and step.shape == ()
    theirs = tvm.runtime.tensor(np.full(4, 7, np.float32), tvm.cpu())
    assert fill_state(state, {"a": theirs}) == (0, 16)
    np.testing.assert_array_equal(own.numpy(), np.full(4, 7))
    assert fill_state(state, {"a": own, "step": step}) == (0, 0)


@I.ir_module
class _Halving:  # x <- 0.5 y + 1 and y <- x each step; stops when k reaches stop_at
    @R.function
    def main(x: R.Tensor(("n", 8), "float32"), y: R.Tensor(("n", 8), "float32"),
             k: R.Tensor((1,), "int32"), stop_at: R.Tensor((1,), "int32")):
        x2 = R.add(R.multiply(y, R.const(0.5, "float32")), R.const(1.0, "float32"))
        k2 = R.add(k, R.const(1, "int32"))
        stop = R.greater_equal(k2, stop_at)
        return (x2, x, k2, stop)


def _halving(x, y, steps):
    for _ in range(steps):
        x, y = y * np.float32(0.5) + np.float32(1.0), x
    return x, y


def test_a_host_loops_state_outlives_runs_at_other_shapes(tmp_path):
    """The state a run returns stays valid until the next run at its shape, and passed back
    continues from there: runs at another shape in between wrote the executor's outputs it
    was, and the continued run read the other shape's values. A value carried through (y,
    the x before) swaps with the loop's own buffers without one overwriting the other."""
    path = grape_tvm.compile_loop(_Halving, ["x", "y", "k"], max_steps=8, dims={"n": (1, 16)},
                                  target="llvm").export(tmp_path / "halving.grape")
    loop = grape_tvm.load_loop(path, "cpu")
    loop.bind_inputs({"stop_at": np.array([100], np.int32)})
    rng = np.random.default_rng(5)
    k0 = np.zeros(1, np.int32)
    a0 = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2)]
    for steps in (1, 2, 3):
        a = loop.run({"x": a0[0], "y": a0[1], "k": k0}, max_steps=steps)
        for n in (5, 7):
            b = [rng.standard_normal((n, 8)).astype(np.float32) for _ in range(2)]
            loop.run({"x": b[0], "y": b[1], "k": k0}, max_steps=steps)
        want = _halving(*a0, steps)
        np.testing.assert_allclose(a.state["x"].numpy(), want[0], rtol=1e-6)
        np.testing.assert_allclose(a.state["y"].numpy(), want[1], rtol=1e-6)
        done = steps
        for more in (1, 2):  # passed back: continued, read in place
            a = loop.run(a.state, max_steps=more)
            done += more
            want = _halving(*a0, done)
            np.testing.assert_allclose(a.state["x"].numpy(), want[0], rtol=1e-6)
            np.testing.assert_allclose(a.state["y"].numpy(), want[1], rtol=1e-6)
            assert int(a.state["k"].numpy()[0]) == done


@pytest.mark.parametrize("kind, conditionals, runs_as", [
    ("cuda", [], "one CUDA graph per state shape"),
    ("cuda", [{"name": "grape_cond_0"}], "a host loop: one call per step"),
    ("llvm", [], "a host loop: one call per step"),
])
def test_inspect_says_the_loop_runner_load_loop_picks(kind, conditionals, runs_as):
    """A CUDA loop whose step branches on data runs as a host loop (``loop_runner``): inspect
    said it ran as one graph."""
    from grape_tvm.cli import _loop_description  # pylint: disable=import-outside-toplevel

    manifest = {"target": {"kind": kind}, "plan": {"conditionals": conditionals},
                "loop": {"carried": ["x"], "stop": "stop", "max_steps": 4}}
    assert _loop_description(manifest)["runs_as"].startswith(runs_as)
