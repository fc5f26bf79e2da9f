"""Benchmark models, built as Relax modules with their weights as inputs.

Weights are inputs so that artifacts stay small (only 64 MiB travel to the GPU machine):
the GPU side creates them from a seed (``block_weights``) for TVM and PyTorch alike.
"""

from __future__ import annotations

import numpy as np


def block_weight_names(depth: int) -> list[str]:
    return [f"{kind}{i}" for i in range(depth) for kind in ("ln_g", "ln_b", "w", "b")]


def block_weights(width: int, depth: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``depth`` blocks' weights, float32, from a seed."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(depth):
        out[f"ln_g{i}"] = (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)
        out[f"ln_b{i}"] = (0.1 * rng.standard_normal(width)).astype(np.float32)
        out[f"w{i}"] = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        out[f"b{i}"] = (0.1 * rng.standard_normal(width)).astype(np.float32)
    return out


def blocks_relax(width: int = 768, depth: int = 24, dim: str = "n"):
    """``x + gelu(layer_norm(x) @ W + b)``, ``depth`` times, x: (n, width), fp32."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    n = tirx.Var(dim, "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, width), "float32"))
    params = [x]
    shapes = {"ln_g": (width,), "ln_b": (width,), "w": (width, width), "b": (width,)}
    weights = {}
    for name in block_weight_names(depth):
        kind = name.rstrip("0123456789")
        weights[name] = relax.Var(name, relax.TensorType(shapes[kind], "float32"))
        params.append(weights[name])
    with bb.function("main", params):
        with bb.dataflow():
            h = x
            for i in range(depth):
                ln = bb.emit(relax.op.nn.layer_norm(h, weights[f"ln_g{i}"], weights[f"ln_b{i}"],
                                                    axes=[-1], epsilon=1e-5))
                mm = bb.emit(relax.op.add(relax.op.matmul(ln, weights[f"w{i}"]), weights[f"b{i}"]))
                h = bb.emit(relax.op.add(h, relax.op.nn.gelu(mm)))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


def blocks_numpy(x: np.ndarray, weights: dict[str, np.ndarray], depth: int) -> np.ndarray:
    """The same blocks in numpy (float64 accumulate), for checking small cases on CPU."""
    from math import erf, sqrt  # pylint: disable=import-outside-toplevel

    verf = np.vectorize(erf)
    h = x.astype(np.float64)
    for i in range(depth):
        mu = h.mean(-1, keepdims=True)
        var = h.var(-1, keepdims=True)
        ln = (h - mu) / np.sqrt(var + 1e-5) * weights[f"ln_g{i}"] + weights[f"ln_b{i}"]
        mm = ln @ weights[f"w{i}"] + weights[f"b{i}"]
        h = h + 0.5 * mm * (1 + verf(mm / sqrt(2)))
    return h.astype(np.float32)
