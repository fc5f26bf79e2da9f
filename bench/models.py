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


GPT2_LAYER = ("ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_o", "b_o", "ln2_g", "ln2_b",
              "w_fc", "b_fc", "w_proj", "b_proj")


def gpt2_shapes(hidden: int, layers: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a GPT-2-shaped decoder's weights, in parameter order."""
    per_layer = {"ln1_g": (hidden,), "ln1_b": (hidden,), "w_qkv": (hidden, 3 * hidden),
                 "b_qkv": (3 * hidden,), "w_o": (hidden, hidden), "b_o": (hidden,),
                 "ln2_g": (hidden,), "ln2_b": (hidden,), "w_fc": (hidden, 4 * hidden),
                 "b_fc": (4 * hidden,), "w_proj": (4 * hidden, hidden), "b_proj": (hidden,)}
    shapes = {f"{kind}{i}": per_layer[kind] for i in range(layers) for kind in GPT2_LAYER}
    return {**shapes, "lnf_g": (hidden,), "lnf_b": (hidden,)}


def gpt2_weights(hidden: int = 768, layers: int = 12, seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2-shaped decoder weights, float32, from a seed (scaled like GPT-2's init)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in gpt2_shapes(hidden, layers).items():
        kind = name.rstrip("0123456789")
        if kind.endswith("_g"):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif kind.endswith("_b") or kind.startswith("b_"):
            out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    return out


def gpt2_output_names(layers: int) -> list[str]:
    return ["y"] + [f"present_{kv}{i}" for i in range(layers) for kv in ("k", "v")]


def gpt2_decode_step(hidden: int = 768, heads: int = 12, layers: int = 12, dim: str = "past"):
    """One GPT-2 decode step, batch 1, with an explicit KV cache.

    Inputs: ``x`` (1, hidden), the new token's hidden state; ``past_k{i}``/``past_v{i}``
    (heads, past, head_dim) per layer; the weights. Outputs: ``y`` (1, hidden) and
    ``present_k{i}``/``present_v{i}`` (heads, past + 1, head_dim): the cache one longer.
    """
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    op = relax.op
    head_dim = hidden // heads
    past = tirx.Var(dim, "int64")
    x = relax.Var("x", relax.TensorType((1, hidden), "float32"))
    caches = [relax.Var(f"past_{kv}{i}", relax.TensorType((heads, past, head_dim), "float32"))
              for i in range(layers) for kv in ("k", "v")]
    weights = {k: relax.Var(k, relax.TensorType(s, "float32"))
               for k, s in gpt2_shapes(hidden, layers).items()}
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *caches, *weights.values()]):
        with bb.dataflow():
            h, presents = x, []
            for i in range(layers):
                w = {kind: weights[f"{kind}{i}"] for kind in GPT2_LAYER}
                ln = bb.emit(op.nn.layer_norm(h, w["ln1_g"], w["ln1_b"], axes=[-1], epsilon=1e-5))
                qkv = bb.emit(op.add(op.matmul(ln, w["w_qkv"]), w["b_qkv"]))  # (1, 3h)
                q, k, v = [bb.emit(op.permute_dims(op.reshape(
                    op.strided_slice(qkv, axes=[1], begin=[j * hidden], end=[(j + 1) * hidden]),
                    (1, heads, head_dim)), [1, 0, 2])) for j in range(3)]  # (heads, 1, d)
                pk = bb.emit(op.concat([caches[2 * i], k], axis=1))  # (heads, past + 1, d)
                pv = bb.emit(op.concat([caches[2 * i + 1], v], axis=1))
                presents += [pk, pv]
                scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(pk, [0, 2, 1])),
                                             relax.const(1.0 / head_dim ** 0.5, "float32")))
                attn = bb.emit(op.matmul(op.nn.softmax(scores, axis=-1), pv))  # (heads, 1, d)
                merged = bb.emit(op.reshape(op.permute_dims(attn, [1, 0, 2]), (1, hidden)))
                h = bb.emit(op.add(h, op.add(op.matmul(merged, w["w_o"]), w["b_o"])))
                ln2 = bb.emit(op.nn.layer_norm(h, w["ln2_g"], w["ln2_b"], axes=[-1], epsilon=1e-5))
                fc = bb.emit(op.nn.gelu(op.add(op.matmul(ln2, w["w_fc"]), w["b_fc"])))
                h = bb.emit(op.add(h, op.add(op.matmul(fc, w["w_proj"]), w["b_proj"])))
            y = bb.emit(op.nn.layer_norm(h, weights["lnf_g"], weights["lnf_b"], axes=[-1],
                                         epsilon=1e-5))
            out = bb.emit_output(relax.Tuple([y, *presents]))
        bb.emit_func_output(out)
    return bb.get()


def gpt2_numpy(x, caches, weights, heads: int, layers: int):
    """The same step in numpy: (y, presents), for checking on the CPU."""
    from math import erf, sqrt  # pylint: disable=import-outside-toplevel

    verf = np.vectorize(erf)

    def ln(v, g, b):
        mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + 1e-5) * g + b

    h = x.astype(np.float64)
    hidden = h.shape[-1]
    d = hidden // heads
    presents = []
    for i in range(layers):
        w = {kind: weights[f"{kind}{i}"] for kind in GPT2_LAYER}
        qkv = ln(h, w["ln1_g"], w["ln1_b"]) @ w["w_qkv"] + w["b_qkv"]
        q, k, v = [qkv[:, j * hidden:(j + 1) * hidden].reshape(1, heads, d).transpose(1, 0, 2)
                   for j in range(3)]
        pk = np.concatenate([caches[2 * i], k], axis=1)
        pv = np.concatenate([caches[2 * i + 1], v], axis=1)
        presents += [pk.astype(np.float32), pv.astype(np.float32)]
        s = q @ pk.transpose(0, 2, 1) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        a = (p @ pv).transpose(1, 0, 2).reshape(1, hidden)
        h = h + a @ w["w_o"] + w["b_o"]
        f = ln(h, w["ln2_g"], w["ln2_b"]) @ w["w_fc"] + w["b_fc"]
        f = 0.5 * f * (1 + verf(f / sqrt(2)))
        h = h + f @ w["w_proj"] + w["b_proj"]
    y = ln(h, weights["lnf_g"], weights["lnf_b"])
    return y.astype(np.float32), presents
