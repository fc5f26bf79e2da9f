"""Benchmark models, built as Relax modules with their weights as inputs.

Weights are inputs so that artifacts stay small (only 64 MiB travel to the GPU machine):
the GPU side creates them from a seed (``block_weights``) for TVM and PyTorch alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

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


def gelu_numpy(v: np.ndarray) -> np.ndarray:
    """GELU by erf, as Relax's ``nn.gelu``, in numpy."""
    from math import erf, sqrt  # pylint: disable=import-outside-toplevel

    return 0.5 * v * (1 + np.vectorize(erf)(v / sqrt(2)))


def layer_norm_numpy(v: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """``nn.layer_norm`` over the last axis, in the dtype of ``v`` (float64 to check)."""
    mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
    return (v - mu) / np.sqrt(var + eps) * g + b


def blocks_numpy(x: np.ndarray, weights: dict[str, np.ndarray], depth: int) -> np.ndarray:
    """The same blocks in numpy (float64 accumulate), for checking small cases on CPU."""
    h = x.astype(np.float64)
    for i in range(depth):
        ln = layer_norm_numpy(h, weights[f"ln_g{i}"], weights[f"ln_b{i}"])
        mm = ln @ weights[f"w{i}"] + weights[f"b{i}"]
        h = h + gelu_numpy(mm)
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


def gpt2_decode_step(hidden: int = 768, heads: int = 12, layers: int = 12, dim: str = "past",
                     tensor_parallel: int = 1):
    """One GPT-2 decode step, batch 1, with an explicit KV cache.

    Inputs: ``x`` (1, hidden), the new token's hidden state; ``past_k{i}``/``past_v{i}``
    (heads, past, head_dim) per layer; the weights. Outputs: ``y`` (1, hidden) and
    ``present_k{i}``/``present_v{i}`` (heads, past + 1, head_dim): the cache one longer.

    ``tensor_parallel`` > 1: annotated for that many devices, Megatron's way
    (``passes.tensor_parallel``): attention by heads (the qkv product split on its columns,
    q, k, v and the caches on their heads, the output projection's product replicated: an
    all-reduce), the MLP by its hidden columns (an all-reduce after its second matmul).
    ``w_qkv{i}`` and ``b_qkv{i}`` then come with their columns in rank order
    (``gpt2_qkv_by_ranks``), so that each device's columns are q, k and v of its heads.
    """
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.tensor_parallel import shard, with_mesh  # pylint: disable=import-outside-toplevel

    if heads % tensor_parallel or (4 * hidden) % tensor_parallel:
        raise ValueError(f"{heads} heads and an MLP of {4 * hidden} columns do not split "
                         f"over {tensor_parallel} devices")
    op = relax.op
    head_dim = hidden // heads
    past = tirx.Var(dim, "int64")
    x = relax.Var("x", relax.TensorType((1, hidden), "float32"))
    caches = [relax.Var(f"past_{kv}{i}", relax.TensorType((heads, past, head_dim), "float32"))
              for i in range(layers) for kv in ("k", "v")]
    weights = {k: relax.Var(k, relax.TensorType(s, "float32"))
               for k, s in gpt2_shapes(hidden, layers).items()}
    bb = relax.BlockBuilder()

    def placed(value, placement):  # the value annotated with its placement on the devices
        if tensor_parallel == 1:
            return value
        return shard(bb, bb.emit(value), placement, tensor_parallel)

    with bb.function("main", [x, *caches, *weights.values()]):
        with bb.dataflow():
            h, presents = x, []
            for i in range(layers):
                w = {kind: weights[f"{kind}{i}"] for kind in GPT2_LAYER}
                ln = bb.emit(op.nn.layer_norm(h, w["ln1_g"], w["ln1_b"], axes=[-1], epsilon=1e-5))
                qkv = bb.emit(op.add(op.matmul(ln, w["w_qkv"]), w["b_qkv"]))  # (1, 3h)
                if tensor_parallel == 1:
                    parts = [op.strided_slice(qkv, axes=[1], begin=[j * hidden],
                                              end=[(j + 1) * hidden]) for j in range(3)]
                else:  # columns (rank, q/k/v, head of the rank, d): each rank's block its own
                    by_rank = bb.emit(op.reshape(shard(bb, qkv, "S[1]", tensor_parallel), (
                        1, tensor_parallel, 3, heads // tensor_parallel, head_dim)))
                    parts = [op.strided_slice(by_rank, axes=[2], begin=[j], end=[j + 1])
                             for j in range(3)]
                q, k, v = [placed(bb.emit(op.permute_dims(op.reshape(part, (1, heads, head_dim)),
                                                          [1, 0, 2])), "S[0]")
                           for part in parts]  # (heads, 1, d)
                past_k, past_v = (placed(c, "S[0]") for c in caches[2 * i:2 * i + 2])
                pk = placed(bb.emit(op.concat([past_k, k], axis=1)), "S[0]")  # (heads, past + 1, d)
                pv = placed(bb.emit(op.concat([past_v, v], axis=1)), "S[0]")
                presents += [pk, pv]
                scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(pk, [0, 2, 1])),
                                             relax.const(1.0 / head_dim ** 0.5, "float32")))
                attn = bb.emit(op.matmul(op.nn.softmax(scores, axis=-1), pv))  # (heads, 1, d)
                merged = bb.emit(op.reshape(op.permute_dims(attn, [1, 0, 2]), (1, hidden)))
                out = placed(op.matmul(merged, w["w_o"]), "R")
                h = bb.emit(op.add(h, op.add(out, w["b_o"])))
                ln2 = bb.emit(op.nn.layer_norm(h, w["ln2_g"], w["ln2_b"], axes=[-1], epsilon=1e-5))
                fc = placed(op.nn.gelu(op.add(op.matmul(ln2, w["w_fc"]), w["b_fc"])), "S[1]")
                if tensor_parallel == 1:
                    fc = bb.emit(fc)
                proj = placed(op.matmul(fc, w["w_proj"]), "R")
                h = bb.emit(op.add(h, op.add(proj, w["b_proj"])))
            y = bb.emit(op.nn.layer_norm(h, weights["lnf_g"], weights["lnf_b"], axes=[-1],
                                         epsilon=1e-5))
            out = bb.emit_output(relax.Tuple([y, *presents]))
        bb.emit_func_output(out)
    mod = bb.get()
    return with_mesh(mod, tensor_parallel) if tensor_parallel > 1 else mod


def gpt2_qkv_by_ranks(weights: dict[str, np.ndarray], heads: int, ranks: int) -> dict[str, np.ndarray]:
    """``weights`` with each ``w_qkv{i}``/``b_qkv{i}``'s columns (q, k, v; head; d) put in
    the order (rank; q, k, v; head of the rank; d) that ``gpt2_decode_step(...,
    tensor_parallel=ranks)`` takes: rank r's block holds q, k and v of heads r * heads /
    ranks onwards."""
    from grape_tvm.passes.megatron import columns_by_ranks  # pylint: disable=import-outside-toplevel

    if heads % ranks:
        raise ValueError(f"{heads} heads do not split over {ranks} devices")
    return {name: columns_by_ranks(value, 3, ranks) if name.startswith(("w_qkv", "b_qkv"))
            else value for name, value in weights.items()}


def gpt2_numpy(x, caches, weights, heads: int, layers: int):
    """The same step in numpy: (y, presents), for checking on the CPU."""

    h = x.astype(np.float64)
    hidden = h.shape[-1]
    d = hidden // heads
    presents = []
    for i in range(layers):
        w = {kind: weights[f"{kind}{i}"] for kind in GPT2_LAYER}
        qkv = layer_norm_numpy(h, w["ln1_g"], w["ln1_b"]) @ w["w_qkv"] + w["b_qkv"]
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
        f = layer_norm_numpy(h, w["ln2_g"], w["ln2_b"]) @ w["w_fc"] + w["b_fc"]
        f = gelu_numpy(f)
        h = h + f @ w["w_proj"] + w["b_proj"]
    y = layer_norm_numpy(h, weights["lnf_g"], weights["lnf_b"])
    return y.astype(np.float32), presents


# -- a whole-token decoder step with a static KV cache: the decode-loop benchmark's model --

# The decode-loop benchmark's decoder, and a tiny one for the tests (``decoder_step`` kwargs).
DECODER_BENCH = {"vocab": 4096, "hidden": 256, "heads": 4, "layers": 4, "max_len": 272}
DECODER_SMALL = {"vocab": 1024, "hidden": 128, "heads": 2, "layers": 2, "max_len": 272}
DECODER_TINY = {"vocab": 64, "hidden": 32, "heads": 2, "layers": 2, "max_len": 24}


def decoder_weights(vocab: int, hidden: int, layers: int, max_len: int,
                    seed: int = 0) -> dict[str, np.ndarray]:
    """Weights of ``decoder_step``: GPT-2's layers, token and position embeddings and an
    output head of its own (with random weights, a tied head repeats the input token)."""
    rng = np.random.default_rng(seed)
    out = gpt2_weights(hidden, layers, seed)
    out["wte"] = (0.5 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    out["wpe"] = (0.1 * rng.standard_normal((max_len, hidden))).astype(np.float32)
    out["head"] = (rng.standard_normal((hidden, vocab)) / np.sqrt(hidden)).astype(np.float32)
    return out


def decoder_state_names(layers: int) -> list[str]:
    """The loop state of ``decoder_step``, in parameter and output order."""
    caches = [f"{kv}{i}" for i in range(layers) for kv in ("k", "v")]
    return ["token", "pos", *caches, "tokens", "done"]


def _cache_write(heads: int, max_len: int, head_dim: int):
    """cache[b, h, pos, :] = new[b, h, :], in place (a Relax ``call_tir_inplace`` kernel)."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    @T.prim_func(private=True, s_tir=True)
    def write_cache(var_cache: T.handle, var_new: T.handle, pos: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        batch = T.int64()
        cache = T.match_buffer(var_cache, (batch, T.int64(heads), T.int64(max_len),
                                           T.int64(head_dim)), "float32")
        new = T.match_buffer(var_new, (batch, T.int64(heads), T.int64(head_dim)), "float32")
        for b, h, d in T.grid(batch, T.int64(heads), T.int64(head_dim)):
            with T.sblock("write"):
                vb, vh, vd = T.axis.remap("SSS", [b, h, d])
                cache[vb, vh, T.Cast("int64", pos[0]), vd] = new[vb, vh, vd]

    return write_cache


def _token_write(max_len: int):
    """tokens[b, pos + 1] = next[b], in place."""
    from tvm.script import tirx as T  # pylint: disable=import-outside-toplevel

    @T.prim_func(private=True, s_tir=True)
    def write_token(var_tokens: T.handle, var_next: T.handle, pos: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True})
        batch = T.int64()
        tokens = T.match_buffer(var_tokens, (batch, max_len), "int32")
        new = T.match_buffer(var_next, (batch,), "int32")
        for b in T.grid(batch):
            with T.sblock("write"):
                vb = T.axis.remap("S", [b])
                tokens[vb, T.Cast("int64", pos[0]) + T.int64(1)] = new[vb]

    return write_token


def decoder_step(vocab: int = 2048, hidden: int = 256, heads: int = 4, layers: int = 4,
                 max_len: int = 288, dim: str = "batch"):
    """One greedy decode step of a GPT-2-style decoder with a static KV cache.

    State (parameters, and outputs in the same order, then ``stop``):
    ``token`` (batch,) int32, the last token; ``pos`` (1,) int32, its position;
    ``k{i}``/``v{i}`` (batch, heads, max_len, head_dim), written in place at ``pos``;
    ``tokens`` (batch, max_len) int32, the sequence, written in place at ``pos + 1``;
    ``done`` (batch,) int32, 1 once a sequence has produced ``eos``. ``stop`` (1,) int32 is
    1 when every sequence is done. A finished sequence keeps producing ``eos``. Loop
    invariants follow the state: ``eos`` (1,) int32, then the weights (``decoder_weights``).
    """
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    op = relax.op
    head_dim = hidden // heads
    batch = tirx.Var(dim, "int64")
    i32 = "int32"
    state = {"token": relax.Var("token", relax.TensorType((batch,), i32)),
             "pos": relax.Var("pos", relax.TensorType((1,), i32))}
    cache_type = relax.TensorType((batch, heads, max_len, head_dim), "float32")
    for i in range(layers):
        for kv in ("k", "v"):
            state[f"{kv}{i}"] = relax.Var(f"{kv}{i}", cache_type)
    state["tokens"] = relax.Var("tokens", relax.TensorType((batch, max_len), i32))
    state["done"] = relax.Var("done", relax.TensorType((batch,), i32))
    shapes = {**gpt2_shapes(hidden, layers), "wte": (vocab, hidden), "wpe": (max_len, hidden),
              "head": (hidden, vocab)}
    weights = {k: relax.Var(k, relax.TensorType(s, "float32")) for k, s in shapes.items()}
    eos = relax.Var("eos", relax.TensorType((1,), i32))
    bb = relax.BlockBuilder()
    write_cache = bb.add_func(_cache_write(heads, max_len, head_dim), "write_cache")
    write_token = bb.add_func(_token_write(max_len), "write_token")
    positions = relax.const(np.arange(max_len, dtype=np.int32))
    with bb.function("main", [*state.values(), eos, *weights.values()]):
        with bb.dataflow():
            pos = state["pos"]
            h = bb.emit(op.add(op.take(weights["wte"], state["token"], axis=0),
                               op.take(weights["wpe"], pos, axis=0)))  # (batch, hidden)
            visible = bb.emit(op.less_equal(positions, pos))  # (max_len,): j <= pos
            caches = []
            for i in range(layers):
                w = {kind: weights[f"{kind}{i}"] for kind in GPT2_LAYER}
                ln = bb.emit(op.nn.layer_norm(h, w["ln1_g"], w["ln1_b"], axes=[-1], epsilon=1e-5))
                qkv = bb.emit(op.add(op.matmul(ln, w["w_qkv"]), w["b_qkv"]))  # (batch, 3h)
                q, k, v = [bb.emit(op.reshape(op.strided_slice(
                    qkv, axes=[1], begin=[j * hidden], end=[(j + 1) * hidden]),
                    (batch, heads, head_dim))) for j in range(3)]
                for kv, new in (("k", k), ("v", v)):
                    caches.append(bb.emit(relax.call_tir_inplace(
                        write_cache, [state[f"{kv}{i}"], new, pos], 0, cache_type)))
                kc, vc = caches[-2], caches[-1]
                scores = bb.emit(op.multiply(
                    op.matmul(op.reshape(q, (batch, heads, 1, head_dim)),
                              op.permute_dims(kc, [0, 1, 3, 2])),
                    relax.const(1.0 / head_dim ** 0.5, "float32")))  # (batch, heads, 1, max_len)
                scores = bb.emit(op.where(visible, scores, relax.const(-1e30, "float32")))
                attn = bb.emit(op.matmul(op.nn.softmax(scores, axis=-1), vc))
                merged = bb.emit(op.reshape(attn, (batch, hidden)))
                h = bb.emit(op.add(h, op.add(op.matmul(merged, w["w_o"]), w["b_o"])))
                ln2 = bb.emit(op.nn.layer_norm(h, w["ln2_g"], w["ln2_b"], axes=[-1], epsilon=1e-5))
                fc = bb.emit(op.nn.gelu(op.add(op.matmul(ln2, w["w_fc"]), w["b_fc"])))
                h = bb.emit(op.add(h, op.add(op.matmul(fc, w["w_proj"]), w["b_proj"])))
            h = bb.emit(op.nn.layer_norm(h, weights["lnf_g"], weights["lnf_b"], axes=[-1],
                                         epsilon=1e-5))
            logits = bb.emit(op.matmul(h, weights["head"]))  # (batch, vocab)
            best = bb.emit(op.astype(op.argmax(logits, axis=1), i32))  # (batch,)
            done = state["done"]
            token = bb.emit(op.where(op.greater(done, relax.const(np.int32(0))), eos, best))
            done_next = bb.emit(op.maximum(done, op.astype(op.equal(token, eos), i32)))
            tokens = bb.emit(relax.call_tir_inplace(
                write_token, [state["tokens"], token, pos], 0,
                relax.TensorType((batch, max_len), i32)))
            pos_next = bb.emit(op.add(pos, relax.const(np.array([1], np.int32))))
            stop = bb.emit(op.reshape(op.min(done_next, axis=[0]), (1,)))  # all done
            out = bb.emit_output(relax.Tuple([token, pos_next, *caches, tokens, done_next, stop]))
        bb.emit_func_output(out)
    return bb.get()


def decoder_initial_state(batch: int, heads: int, head_dim: int, layers: int, max_len: int,
                          bos: int = 1) -> dict[str, np.ndarray]:
    """Sequence b starts from token ``bos + b`` at position 0, with an empty cache."""
    state = {"token": (bos + np.arange(batch)).astype(np.int32), "pos": np.zeros((1,), np.int32)}
    for i in range(layers):
        for kv in ("k", "v"):
            state[f"{kv}{i}"] = np.zeros((batch, heads, max_len, head_dim), np.float32)
    tokens = np.zeros((batch, max_len), np.int32)
    tokens[:, 0] = state["token"]
    state["tokens"] = tokens
    state["done"] = np.zeros((batch,), np.int32)
    return state


BRANCH_WEIGHTS = ("w_in", "w_then0", "w_then1", "w_then2", "w_else")


def branch_model(width: int = 512):
    """A data-dependent early exit: ``h = gelu(x @ w_in)``; if ``mean(h) > threshold`` three
    more layers, else one; then ``+ x``. x: (n, width), fp32, weights and threshold inputs.

    The condition is computed on the device: TVM's VM reads it on the host (a sync per
    call); grape runs both branches' graphs guarded by it (``BranchesToConditionalRegions``).
    """
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, width), "float32"))
    w = {k: relax.Var(k, relax.TensorType((width, width), "float32")) for k in BRANCH_WEIGHTS}
    threshold = relax.Var("threshold", relax.TensorType((), "float32"))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *w.values(), threshold]):
        h = bb.emit(op.nn.gelu(op.matmul(x, w["w_in"])))
        cond = bb.emit(op.greater(op.mean(h), threshold))
        r = relax.Var("r", relax.TensorType((n, width), "float32"))
        then_bb = []
        a = h
        for k in ("w_then0", "w_then1", "w_then2"):
            v = relax.Var(f"t_{k}", relax.TensorType((n, width), "float32"))
            then_bb.append(relax.VarBinding(v, op.nn.gelu(op.matmul(a, w[k]))))
            a = v
        e = relax.Var("e", relax.TensorType((n, width), "float32"))
        else_bb = [relax.VarBinding(e, op.nn.relu(op.matmul(h, w["w_else"])))]
        branch = relax.If(cond, relax.SeqExpr([relax.BindingBlock(then_bb)], a),
                          relax.SeqExpr([relax.BindingBlock(else_bb)], e))
        r = bb.emit(branch)
        y = bb.emit(op.add(r, x))
        bb.emit_func_output(y)
    return relax.transform.Normalize()(bb.get())


def branch_weights(width: int = 512, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            for k in BRANCH_WEIGHTS}


def branch_numpy(x: np.ndarray, weights: dict[str, np.ndarray], threshold: float) -> np.ndarray:
    """``branch_model`` in numpy (float64; gelu by erf, as Relax's)."""
    gelu = gelu_numpy
    x64 = x.astype(np.float64)
    h = gelu(x64 @ weights["w_in"])
    if h.mean() > threshold:
        r = h
        for k in ("w_then0", "w_then1", "w_then2"):
            r = gelu(r @ weights[k])
    else:
        r = np.maximum(h @ weights["w_else"], 0)
    return r + x64


REDUCTION_OUTPUTS = ("mean", "above", "sum_rows", "sum_all", "max", "min")


def reductions_model(width: int = 512):
    """Reductions of x: (n, width), fp32, over the symbolic n; n may be 0. Outputs
    (``REDUCTION_OUTPUTS``): ``mean(x)`` and ``mean(x) > threshold`` (``branch_model``'s
    condition), ``sum(x, axis=0, keepdims)`` (1, width) and ``sum(x, keepdims)`` (1, 1),
    ``max(x)`` and ``min(x, keepdims)`` (1, 1).

    On CUDA the means, the max and the min are grape's ``FullReduction`` (one thread block),
    the sums dlight's ``Reduction``.
    """
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    op = relax.op
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, width), "float32"))
    threshold = relax.Var("threshold", relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, threshold]):
        with bb.dataflow():
            outs = [op.mean(x), op.greater(op.mean(x), threshold),
                    op.sum(x, axis=[0], keepdims=True), op.sum(x, keepdims=True),
                    op.max(x), op.min(x, axis=[0, 1], keepdims=True)]
            out = bb.emit_output(relax.Tuple([bb.emit(o) for o in outs]))
        bb.emit_func_output(out)
    return bb.get()


# -- single matmuls: grape's GEMV kernels (passes/gemv_schedule.py) ------------------------

# GPT-2 124M's matmul shapes (K, N): QKV, attention output, MLP up, MLP down, LM head.
GPT2_MATMULS = ((768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257))


def matmul_relax(k: int, n: int, dtype: str = "float32", layout: str = "kn", dim: str = "m"):
    """``y = x @ W``, x: (m, k); W: (k, n) ("kn", Hugging Face's Conv1D) or (n, k) ("nk",
    ``nn.Linear``: ``x @ permute_dims(W)``, which grape's GPU pipeline reads in place,
    ``FuseWeightTranspose``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    m = tirx.Var(dim, "int64")
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    w = relax.Var("w", relax.TensorType((k, n) if layout == "kn" else (n, k), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            wt = w if layout == "kn" else relax.op.permute_dims(w, [1, 0])
            y = bb.emit_output(relax.op.matmul(x, wt))
        bb.emit_func_output(y)
    return bb.get()


def gemv_chain_relax(k: int, n: int, layers: int, dtype: str = "float32", dim: str = "m"):
    """``y_i = x @ W_i + b_i`` for i < ``layers``, each W_i: (k, n) as Hugging Face's Conv1D
    holds it, every y_i an output: ``layers`` GEMVs of one shape in one graph, their weights
    ``w{i}``, ``b{i}`` (``bench/gemv_chain.py``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    m = tirx.Var(dim, "int64")
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    params = [x]
    for i in range(layers):
        params += [relax.Var(f"w{i}", relax.TensorType((k, n), dtype)),
                   relax.Var(f"b{i}", relax.TensorType((n,), dtype))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            ys = [bb.emit(relax.op.add(relax.op.matmul(x, w), b))
                  for w, b in zip(params[1::2], params[2::2])]
            out = bb.emit_output(relax.Tuple(ys))
        bb.emit_func_output(out)
    return bb.get()


def mlp_chain_relax(layers: int, dtype: str = "float32", width: int = 768, hidden: int = 3072,
                    dim: str = "m"):
    """``layers`` of GPT-2's MLP without its norm: ``x = gelu(x @ W1 + b1) @ W2 + b2 + x``
    (tanh GELU, as GPT-2's ``gelu_new``), weights ``w1_{i}``, ``b1_{i}``, ``w2_{i}``,
    ``b2_{i}`` stored (k, n) (``bench/gemv_chain.py``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    op = relax.op
    m = tirx.Var(dim, "int64")
    x = relax.Var("x", relax.TensorType((m, width), dtype))
    params = [x]
    for i in range(layers):
        params += [relax.Var(f"w1_{i}", relax.TensorType((width, hidden), dtype)),
                   relax.Var(f"b1_{i}", relax.TensorType((hidden,), dtype)),
                   relax.Var(f"w2_{i}", relax.TensorType((hidden, width), dtype)),
                   relax.Var(f"b2_{i}", relax.TensorType((width,), dtype))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            h = x
            for i in range(layers):
                w1, b1, w2, b2 = params[1 + 4 * i: 5 + 4 * i]
                up = bb.emit(op.nn.gelu_tanh(op.add(op.matmul(h, w1), b1)))
                h = bb.emit(op.add(op.add(op.matmul(up, w2), b2), h))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    return bb.get()


# The GPU tests' matmuls: K = 256; y's N is a multiple of the 16-byte vector (516 for fp32,
# 520 for fp16: the last column tile is partly padding), z's N = 102 is not (scalar loads of
# [K, N] weights, padding in every layout).
GEMV_TEST_K, GEMV_TEST_N2 = 256, 102
GEMV_TEST_N1 = {"float32": 516, "float16": 520}


def gemv_test_relax(dtype: str = "float32", layout: str = "kn", dim: str = "m"):
    """``y = gelu(x @ W1 + b1)`` and ``z = x @ W2 + b2``, x: (m, 256); W as in
    ``matmul_relax``."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    op = relax.op
    m = tirx.Var(dim, "int64")
    k, n1, n2 = GEMV_TEST_K, GEMV_TEST_N1[dtype], GEMV_TEST_N2
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    ws = [relax.Var(f"w{i}", relax.TensorType((k, n) if layout == "kn" else (n, k), dtype))
          for i, n in ((1, n1), (2, n2))]
    bs = [relax.Var(f"b{i}", relax.TensorType((n,), dtype)) for i, n in ((1, n1), (2, n2))]
    bb = relax.BlockBuilder()
    with bb.function("main", [x, ws[0], bs[0], ws[1], bs[1]]):
        with bb.dataflow():
            wt = [w if layout == "kn" else op.permute_dims(w, [1, 0]) for w in ws]
            y = bb.emit(op.nn.gelu(op.add(op.matmul(x, wt[0]), bs[0])))
            z = bb.emit(op.add(op.matmul(x, wt[1]), bs[1]))
            out = bb.emit_output(relax.Tuple([y, z]))
        bb.emit_func_output(out)
    return bb.get()


def gemv_test_constants(dtype: str = "float32", seed: int = 7):
    """``gemv_test_relax`` ("kn") with its weights and biases bound as constants (an ONNX
    model's initializers), x its one input; those weights (``gemv_test_inputs`` at
    ``seed``) for the reference."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    weights = {k: v for k, v in gemv_test_inputs(1, dtype, "kn", seed).items() if k != "x"}
    bound = relax.transform.BindParams("main", weights)(gemv_test_relax(dtype, "kn"))
    return bound, weights


def reductions_numpy(x: np.ndarray, threshold: float) -> dict[str, np.ndarray]:
    """``reductions_model`` in numpy (float64 sums); over n = 0 the identities grape gives:
    0 for the sums and the mean, -inf for the max, +inf for the min."""
    x64 = x.astype(np.float64)
    mean = x64.sum() / max(x.size, 1)
    return {"mean": np.array(mean), "above": np.array(mean > threshold),
            "sum_rows": x64.sum(0, keepdims=True), "sum_all": x64.sum(keepdims=True),
            "max": np.array(x.max(initial=-np.inf)),
            "min": x.min(axis=(0, 1), keepdims=True, initial=np.inf)}


LIBRARY_SHAPE = {"k": 768, "n": 3072}  # GPT-2's MLP: (K, N) of its up projection


def library_layer(dtype: str = "float32", gelu: str = "tanh", norm: bool = False):
    """A GPT-2 MLP with its matmuls as cuBLASLt calls on CUDA (``OffloadMatmul``):
    ``h = gelu_tanh(x @ w_up + b_up)`` (bias and GELU in cuBLASLt's epilogue), ``y = h @
    w_down_t^T + x`` (a weight stored [N, K]; the residual added by cuBLASLt as its C).
    x: (n, 768). ``gelu="erf"``: ``nn.gelu`` instead, which cuBLASLt's epilogue lacks
    (grape's GEMV kernels fuse it; ``passes/few_rows_gemv.py``). ``norm``: each matmul reads
    a layer norm of its input (``ln_up`` of x, ``ln_down`` of h), which grape's GEMV kernels
    compute themselves."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    k, n_up = LIBRARY_SHAPE["k"], LIBRARY_SHAPE["n"]
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, k), dtype))
    w_up = relax.Var("w_up", relax.TensorType((k, n_up), dtype))
    b_up = relax.Var("b_up", relax.TensorType((n_up,), dtype))
    w_down_t = relax.Var("w_down_t", relax.TensorType((k, n_up), dtype))
    norms = {f"{name}_{p}": relax.Var(f"{name}_{p}", relax.TensorType((width,), dtype))
             for name, width in (("ln_up", k), ("ln_down", n_up)) for p in ("g", "b")
             if norm}
    op = relax.op

    bb = relax.BlockBuilder()

    def normed(v, name):
        if not norm:
            return v
        return bb.emit(op.nn.layer_norm(v, norms[f"{name}_g"], norms[f"{name}_b"], axes=[-1],
                                        epsilon=1e-5))

    with bb.function("main", [x, w_up, b_up, w_down_t, *norms.values()]):
        with bb.dataflow():
            activation = {"tanh": op.nn.gelu_tanh, "erf": op.nn.gelu}[gelu]
            h = bb.emit(activation(op.add(op.matmul(normed(x, "ln_up"), w_up), b_up)))
            y = bb.emit_output(op.add(op.matmul(normed(h, "ln_down"), op.permute_dims(w_down_t)),
                                      x))
            h = bb.emit_output(h)
        bb.emit_func_output(relax.Tuple([y, h]))
    return bb.get()


def library_weights(dtype: str = "float32", seed: int = 0,
                    norm: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    k, n_up = LIBRARY_SHAPE["k"], LIBRARY_SHAPE["n"]
    weights = {"w_up": (rng.standard_normal((k, n_up)) / np.sqrt(k)).astype(dtype),
               "b_up": (0.1 * rng.standard_normal(n_up)).astype(dtype),
               "w_down_t": (rng.standard_normal((k, n_up)) / np.sqrt(n_up)).astype(dtype)}
    for name, width in (("ln_up", k), ("ln_down", n_up)) if norm else ():
        weights[f"{name}_g"] = (1 + 0.1 * rng.standard_normal(width)).astype(dtype)
        weights[f"{name}_b"] = (0.1 * rng.standard_normal(width)).astype(dtype)
    return weights


def library_numpy(x: np.ndarray, weights: dict[str, np.ndarray],
                  gelu: str = "tanh") -> tuple[np.ndarray, np.ndarray]:
    """``library_layer`` in float64: (y, h); with its layer norms where ``weights`` has
    them."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    x64 = x.astype(np.float64)

    def normed(v, name):
        return layer_norm_numpy(v, w[f"{name}_g"], w[f"{name}_b"]) if f"{name}_g" in w else v

    pre = normed(x64, "ln_up") @ w["w_up"] + w["b_up"]
    if gelu == "erf":
        h = 0.5 * pre * (1 + np.frompyfunc(math.erf, 1, 1)(pre / np.sqrt(2)).astype(np.float64))
    else:
        h = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre ** 3)))
    return normed(h, "ln_down") @ w["w_down_t"].T + x64, h


ATTENTION_HEADS, ATTENTION_HEAD_DIM = 12, 64  # GPT-2's
UNFUSED_HEAD_DIM = 80  # no attention kernel of grape's takes it: cuBLASLt's products run it


# Outputs of odd width from weights stored [N, K]: GPT-2's LM head (50257, more rows than
# the runtime's scratch holds at once) and a narrower one with a bias (one chunk).
WIDE_HEAD_SHAPE = {"k": 64, "n": 50257, "n_bias": 4099}


def wide_head(dtype: str = "float16"):
    """``y = x @ w^T`` and ``z = x @ v^T + b`` with w: (50257, 64), v: (4099, 64), x: (n,
    64): 16-bit outputs whose rows misalign, which cuBLASLt runs split
    (``runtime/cublaslt.py``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    k, n_out, n_bias = (WIDE_HEAD_SHAPE[key] for key in ("k", "n", "n_bias"))
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, k), dtype))
    w = relax.Var("w", relax.TensorType((n_out, k), dtype))
    v = relax.Var("v", relax.TensorType((n_bias, k), dtype))
    b = relax.Var("b", relax.TensorType((n_bias,), dtype))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, v, b]):
        with bb.dataflow():
            y = bb.emit_output(op.matmul(x, op.permute_dims(w)))
            z = bb.emit_output(op.add(op.matmul(x, op.permute_dims(v)), b))
        bb.emit_func_output(relax.Tuple([y, z]))
    return bb.get()


def wide_head_weights(dtype: str = "float16", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    k, n_out, n_bias = (WIDE_HEAD_SHAPE[key] for key in ("k", "n", "n_bias"))
    return {"w": (rng.standard_normal((n_out, k)) / np.sqrt(k)).astype(dtype),
            "v": (rng.standard_normal((n_bias, k)) / np.sqrt(k)).astype(dtype),
            "b": rng.standard_normal(n_bias).astype(dtype)}


def wide_head_numpy(x: np.ndarray, weights: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``wide_head`` in float64: (y, z)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    x64 = x.astype(np.float64)
    return x64 @ w["w"].T, x64 @ w["v"].T + w["b"]


def attention_products(dtype: str = "float32", head_dim: int = ATTENTION_HEAD_DIM,
                       mask: bool = False):
    """A decode step's attention over a symbolic past (the shape GPT-2's ONNX export has):
    ``o = softmax(q @ k^T / sqrt(d) [+ mask]) @ v``, q: (b, 12, 1, d), k and v: (b, 12, p, d),
    ``mask`` (b, 1, 1, p) an input added to the scores (Hugging Face's attention mask). On
    CUDA one call of grape's decode attention kernel (``FuseAttention``) where it has a
    kernel for ``head_dim`` (64, 128), else both products strided-batched cuBLASLt calls
    (``OffloadMatmul``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    b, p = tirx.Var("b", "int64"), tirx.Var("p", "int64")
    h, d = ATTENTION_HEADS, head_dim
    q = relax.Var("q", relax.TensorType((b, h, 1, d), dtype))
    k = relax.Var("k", relax.TensorType((b, h, p, d), dtype))
    v = relax.Var("v", relax.TensorType((b, h, p, d), dtype))
    params = [q, k, v]
    if mask:
        params.append(relax.Var("mask", relax.TensorType((b, 1, 1, p), dtype)))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                                         relax.const(d ** -0.5, dtype)))
            if mask:
                scores = bb.emit(op.add(scores, params[-1]))
            o = bb.emit_output(op.matmul(op.nn.softmax(scores, axis=-1), v))
        bb.emit_func_output(o)
    return bb.get()


def cached_attention(dtype: str = "float32", head_dim: int = ATTENTION_HEAD_DIM):
    """A decode step's attention appending to its cache, as GPT-2's ONNX export has it:
    q, k_new and v_new heads of a packed qkv (b, 1, 3 * 12 * d), ``present_k =
    concat((past_k, k_new), axis=-2)`` (past (b, 12, p, d)) and the same for v (bound after
    the softmax), ``o = softmax(q @ present_k^T / sqrt(d) + mask) @ present_v``, mask
    (b, 1, 1, p + 1); outputs ``(o, present_k, present_v)``. On CUDA one call of grape's
    decode attention kernel that also writes the presents (``FuseAttention``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    b, p = tirx.Var("b", "int64"), tirx.Var("p", "int64")
    h, d = ATTENTION_HEADS, head_dim
    qkv = relax.Var("qkv", relax.TensorType((b, 1, 3 * h * d), dtype))
    past_k = relax.Var("past_k", relax.TensorType((b, h, p, d), dtype))
    past_v = relax.Var("past_v", relax.TensorType((b, h, p, d), dtype))
    mask = relax.Var("mask", relax.TensorType((b, 1, 1, p + 1), dtype))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [qkv, past_k, past_v, mask]):
        with bb.dataflow():
            heads = bb.emit(op.reshape(qkv, (b, 1, 3 * h, d)))
            q, k, v = (bb.emit(op.permute_dims(op.strided_slice(
                heads, axes=[2], begin=[i * h], end=[(i + 1) * h]), [0, 2, 1, 3]))
                for i in range(3))
            present_k = bb.emit(op.concat([past_k, k], axis=-2))
            scores = bb.emit(op.add(op.multiply(op.matmul(q, op.permute_dims(present_k,
                                                                          [0, 1, 3, 2])),
                                                relax.const(d ** -0.5, dtype)), mask))
            probs = bb.emit(op.nn.softmax(scores, axis=-1))
            present_v = bb.emit(op.concat([past_v, v], axis=-2))
            o = bb.emit(op.matmul(probs, present_v))
            out = bb.emit_output(relax.Tuple([o, present_k, present_v]))
        bb.emit_func_output(out)
    return bb.get()


def cached_attention_numpy(qkv: np.ndarray, past_k: np.ndarray, past_v: np.ndarray,
                           mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``cached_attention``'s outputs in float64: o, present_k, present_v."""
    b, h, _, d = past_k.shape
    q, k, v = np.swapaxes(qkv.reshape(b, 1, 3, h, d), 1, 3).transpose(2, 0, 1, 3, 4)
    present_k = np.concatenate([past_k, k], axis=2)
    present_v = np.concatenate([past_v, v], axis=2)
    return attention_numpy(q, present_k, present_v, mask), present_k, present_v


def attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                    bias: np.ndarray | float = 0.0) -> np.ndarray:
    """``softmax(q @ k^T / sqrt(d) + bias) @ v`` in float64 (``attention_products``,
    ``dense_attention``)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = q @ np.swapaxes(k, -1, -2) * q.shape[-1] ** -0.5 + np.asarray(bias, np.float64)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ v


def gemv_test_inputs(m: int, dtype: str, layout: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of ``gemv_test_relax`` at m rows, from a seed (W scaled by 1/sqrt(K))."""
    rng = np.random.default_rng(seed)
    k, n1, n2 = GEMV_TEST_K, GEMV_TEST_N1[dtype], GEMV_TEST_N2
    out = {"x": rng.standard_normal((m, k))}
    for i, n in ((1, n1), (2, n2)):
        w = rng.standard_normal((k, n)) / np.sqrt(k)
        out[f"w{i}"] = w if layout == "kn" else np.ascontiguousarray(w.T)
        out[f"b{i}"] = 0.1 * rng.standard_normal(n)
    return {name: value.astype(dtype) for name, value in out.items()}


def gemv_test_numpy(inputs: dict[str, np.ndarray], layout: str) -> tuple[np.ndarray, np.ndarray]:
    """``gemv_test_relax`` in float64 from the same (rounded) inputs: (y, z)."""
    f = {name: value.astype(np.float64) for name, value in inputs.items()}
    w1, w2 = (f["w1"], f["w2"]) if layout == "kn" else (f["w1"].T, f["w2"].T)
    h = f["x"] @ w1 + f["b1"]
    y = gelu_numpy(h)
    return y, f["x"] @ w2 + f["b2"]


# A Wav2Vec2-like front end: strided convs over raw audio, then a grouped convolution with
# "same" padding (the positional embedding), as HF's ONNX export writes them.
CONV_STACK = {"channels": 64, "groups": 4, "pos_kernel": 16}
# (in channels, kernel, stride) of each feature conv: the first (1 channel, kernel 10) has a
# reduction below passes/conv_matmul.py's MIN_REDUCTION and stays TVM's conv.
CONV_LAYERS = ((1, 10, 5), (64, 3, 2), (64, 2, 2))


def conv_stack(dtype: str = "float32", dim: str = "samples"):
    """``feat = gelu(conv(... gelu(conv(x))))`` over (b, samples) audio, then ``pos =
    gelu(grouped_conv(feat, padding k/2)[..., :t])``; outputs (feat, pos)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    op = relax.op
    b, s = tirx.Var("b", "int64"), tirx.Var(dim, "int64")
    c, groups, pk = CONV_STACK["channels"], CONV_STACK["groups"], CONV_STACK["pos_kernel"]
    x = relax.Var("x", relax.TensorType((b, s), dtype))
    weights = [relax.Var(f"w{i}", relax.TensorType((c, cin, k), dtype))
               for i, (cin, k, _) in enumerate(CONV_LAYERS)]
    w_pos = relax.Var("w_pos", relax.TensorType((c, c // groups, pk), dtype))
    b_pos = relax.Var("b_pos", relax.TensorType((c,), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, *weights, w_pos, b_pos]):
        with bb.dataflow():
            h = bb.emit(op.expand_dims(x, 1))
            for w, (_, _, stride) in zip(weights, CONV_LAYERS):
                h = bb.emit(op.nn.gelu(op.nn.conv1d(h, w, strides=stride)))
            feat = bb.emit_output(h)
            length = h.ty.shape.values[2]
            conv = bb.emit(op.add(op.nn.conv1d(h, w_pos, padding=pk // 2, groups=groups),
                                  op.reshape(b_pos, (1, c, 1))))
            pos = bb.emit_output(op.nn.gelu(op.strided_slice(conv, [2], [0], [length],
                                                              assume_inbound=True)))
        bb.emit_func_output(relax.Tuple([feat, pos]))
    return bb.get()


def conv_stack_weights(dtype: str = "float32", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c, groups, pk = CONV_STACK["channels"], CONV_STACK["groups"], CONV_STACK["pos_kernel"]
    weights = {f"w{i}": rng.standard_normal((c, cin, k)) / np.sqrt(cin * k)
               for i, (cin, k, _) in enumerate(CONV_LAYERS)}
    weights["w_pos"] = rng.standard_normal((c, c // groups, pk)) / np.sqrt(c // groups * pk)
    weights["b_pos"] = 0.1 * rng.standard_normal(c)
    return {k: v.astype(dtype) for k, v in weights.items()}


def conv1d_numpy(x: np.ndarray, w: np.ndarray, stride: int = 1, padding: int = 0,
                 groups: int = 1) -> np.ndarray:
    """conv1d (NCW, OIW) in float64 from numpy's sliding windows."""
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding, padding)))
    w = w.astype(np.float64)
    out_per_group, per_group, k = w.shape[0] // groups, w.shape[1], w.shape[2]
    windows = np.lib.stride_tricks.sliding_window_view(x, k, axis=2)[:, :, ::stride]  # b c t k
    parts = [np.einsum("bctk,ock->bot", windows[:, g * per_group:(g + 1) * per_group],
                       w[g * out_per_group:(g + 1) * out_per_group]) for g in range(groups)]
    return np.concatenate(parts, axis=1)


def conv_stack_numpy(x: np.ndarray, weights: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``conv_stack`` in float64: (feat, pos)."""
    h = x.astype(np.float64)[:, None, :]
    for i, (_, _, stride) in enumerate(CONV_LAYERS):
        h = gelu_numpy(conv1d_numpy(h, weights[f"w{i}"], stride))
    groups, pk = CONV_STACK["groups"], CONV_STACK["pos_kernel"]
    conv = conv1d_numpy(h, weights["w_pos"], padding=pk // 2, groups=groups)
    conv = conv + weights["b_pos"].astype(np.float64)[None, :, None]
    return h, gelu_numpy(conv[:, :, :h.shape[2]])


def causal_attention(dtype: str = "float16", heads: int = ATTENTION_HEADS,
                     head_dim: int = ATTENTION_HEAD_DIM, mask: str = "causal",
                     masked: float = -65504.0):
    """A prefill's attention as GPT-2's ONNX export writes it, over (b, s, 3 * heads *
    head_dim) qkv: heads sliced out of a reshape and transposed, ``softmax(q @ k^T / sqrt(d)
    + bias) @ v`` transposed back to (b, s, heads * head_dim). ``mask``: "causal" (the bias
    ``where(key <= query, 0, masked)`` from aranges, as Hugging Face computes it) or "bias"
    (an input ``bias`` of (b, 1, s, s) added). On CUDA one call of grape's fused attention
    (``passes.FuseAttention``)."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    h, d = heads, head_dim
    qkv = relax.Var("qkv", relax.TensorType((b, s, 3 * h * d), dtype))
    params = [qkv]
    if mask == "bias":
        params.append(relax.Var("bias", relax.TensorType((b, 1, s, s), dtype)))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            split = bb.emit(op.reshape(qkv, (b, s, 3 * h, d)))
            q, k, v = (bb.emit(op.permute_dims(op.strided_slice(split, [2], [i * h], [(i + 1) * h]),
                                               [0, 2, 1, 3])) for i in range(3))
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                                         relax.const(d ** -0.5, dtype)))
            if mask == "causal":
                rows = op.expand_dims(op.arange(0, s, 1, "int64"), [0, 1, 3])  # (1, 1, s, 1)
                keys = op.expand_dims(op.arange(0, s, 1, "int64"), [0, 1, 2])  # (1, 1, 1, s)
                allowed = op.broadcast_to(op.less_equal(keys, rows), (b, 1, s, s))
                bias = bb.emit(op.where(allowed, relax.const(0.0, dtype),
                                        relax.const(masked, dtype)))
            else:
                bias = params[1]
            probs = bb.emit(op.nn.softmax(op.add(scores, bias), axis=-1))
            out = bb.emit(op.permute_dims(op.matmul(probs, v), [0, 2, 1, 3]))
            y = bb.emit_output(op.reshape(out, (b, s, h * d)))
        bb.emit_func_output(y)
    return bb.get()


def causal_attention_numpy(qkv: np.ndarray, heads: int, bias: np.ndarray | None = None,
                           masked: float = -65504.0) -> np.ndarray:
    """``causal_attention`` in float64: causal (``masked`` above the diagonal) where ``bias``
    is None."""
    b, s, width = qkv.shape
    d = width // (3 * heads)
    q, k, v = qkv.reshape(b, s, 3, heads, d).transpose(2, 0, 3, 1, 4)  # each (b, h, s, d)
    if bias is None:
        bias = np.where(np.arange(s)[None, :] <= np.arange(s)[:, None], 0.0, masked)
    out = attention_numpy(q, k, v, bias)
    return out.transpose(0, 2, 1, 3).reshape(b, s, heads * d)


def dense_attention(dtype: str = "float16", heads: int = ATTENTION_HEADS,
                    head_dim: int = ATTENTION_HEAD_DIM):
    """``softmax(q @ k^T / sqrt(d) + bias) @ v`` over separate (b, h, s, d) inputs q, k and v
    and a (s, s) bias broadcast over batch and heads, the output left (b, h, s, d): on CUDA
    grape's fused attention reading each operand dense and the bias with strides of 0."""
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    b, s = tirx.Var("b", "int64"), tirx.Var("s", "int64")
    q, k, v = (relax.Var(n, relax.TensorType((b, heads, s, head_dim), dtype)) for n in "qkv")
    bias = relax.Var("bias", relax.TensorType((s, s), dtype))
    op = relax.op
    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            scores = bb.emit(op.multiply(op.matmul(q, op.permute_dims(k, [0, 1, 3, 2])),
                                         relax.const(head_dim ** -0.5, dtype)))
            probs = bb.emit(op.nn.softmax(op.add(scores, bias), axis=-1))
            y = bb.emit_output(op.matmul(probs, v))
        bb.emit_func_output(y)
    return bb.get()



# -- a Llama-architecture decode step: tensor parallelism's GPU benchmark (issue 16) --------

@dataclass(frozen=True)
class LlamaConfig:
    """A Llama decoder's sizes (Hugging Face's ``LlamaConfig`` names, shortened)."""

    hidden: int
    heads: int
    kv_heads: int
    layers: int
    intermediate: int
    vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA_7B = LlamaConfig(hidden=4096, heads=32, kv_heads=32, layers=32, intermediate=11008,
                       vocab=32000)
LLAMA_TINY = LlamaConfig(hidden=64, heads=4, kv_heads=4, layers=2, intermediate=96, vocab=50)
LLAMA_LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def llama_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of ``llama_decode_step``'s weights, in parameter order; products
    are (in, out): ``x @ w``."""
    h, inter = config.hidden, config.intermediate
    per_layer = {"attn_norm": (h,), "wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h),
                 "mlp_norm": (h,), "w_gate": (h, inter), "w_up": (h, inter),
                 "w_down": (inter, h)}
    shapes = {f"{kind}{i}": per_layer[kind] for i in range(config.layers) for kind in LLAMA_LAYER}
    return {**shapes, "final_norm": (h,), "lm_head": (h, config.vocab)}


def llama_weight_init(name: str) -> tuple[float, float]:
    """(mean, standard deviation) of weight ``name``'s random values: norms near 1, the
    products at Llama's init scale (0.02). ``llama_weights`` and the GPU benchmark's
    generator draw from the same distributions."""
    return (1.0, 0.1) if name.rstrip("0123456789").endswith("norm") else (0.0, 0.02)


def llama_weights(config: LlamaConfig, seed: int = 0, dtype: str = "float32"
                  ) -> dict[str, np.ndarray]:
    """``llama_decode_step``'s weights from a seed (numpy: the CPU tests' sizes)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in llama_shapes(config).items():
        mean, std = llama_weight_init(name)
        out[name] = (mean + std * rng.standard_normal(shape)).astype(dtype)
    return out


def llama_rotary(config: LlamaConfig, positions, dtype: str = "float32"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (batch, head_dim), of the new token at ``positions`` (one a sequence):
    Hugging Face's convention, each frequency twice (``cat(freqs, freqs)``), computed in
    float64 and rounded to ``dtype``."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    freqs = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def llama_cache_names(layers: int) -> list[str]:
    return [f"past_{kv}{i}" for i in range(layers) for kv in ("k", "v")]


def llama_output_names(layers: int) -> list[str]:
    return ["logits"] + [f"present_{kv}{i}" for i in range(layers) for kv in ("k", "v")]


def llama_decode_step(config: LlamaConfig, tensor_parallel: int = 1, dtype: str = "float16",
                      batch: str = "batch", past: str = "past"):
    """One Llama decode step: a batch of sequences, one new token each, with an explicit
    KV cache per layer.

    Inputs: ``x`` (batch, hidden), the new token's embedding (the caller gathers it: the
    embedding table stays out of the model); ``cos``/``sin`` (batch, head_dim), the rotary
    tables of its position (``llama_rotary``: inputs, since a tensor constant does not
    survive a sharded build); ``past_k{i}``/``past_v{i}`` (batch, heads, past, head_dim);
    the weights (``llama_shapes``). Outputs: ``logits`` (batch, vocab) and
    ``present_k{i}``/``present_v{i}`` (batch, heads, past + 1, head_dim).

    A layer: RMSNorm, q/k/v products (no bias), rotary embedding on q and k (``rotate_half``),
    attention over the cache and the new token, the output product, a residual; RMSNorm,
    SwiGLU (``silu(x @ gate) * (x @ up) @ down``), a residual. Then RMSNorm and the LM head.
    In float16 the norms and the softmax run in float32 (as Hugging Face's Llama does), the
    products accumulate in float32 where they run (cuBLASLt), the rest is float16.

    ``tensor_parallel`` > 1: annotated for that many devices, Megatron's way: q, k, v
    column-parallel (each rank its heads; the caches split on the head axis), ``wo``
    row-parallel (an all-reduce), gate and up column-parallel, down row-parallel (an
    all-reduce); the norms, the LM head and the logits replicated.
    """
    from tvm import relax, tirx  # pylint: disable=import-outside-toplevel

    from grape_tvm.passes.tensor_parallel import shard, with_mesh  # pylint: disable=import-outside-toplevel

    if config.kv_heads != config.heads:
        raise ValueError(f"{config.kv_heads} kv heads for {config.heads} heads: grouped-query "
                         "attention is not modelled here")
    if config.heads % tensor_parallel or config.intermediate % tensor_parallel:
        raise ValueError(f"{config.heads} heads and an MLP of {config.intermediate} columns "
                         f"do not split over {tensor_parallel} devices")
    op = relax.op
    heads, d, hidden = config.heads, config.head_dim, config.hidden
    b, length = tirx.Var(batch, "int64"), tirx.Var(past, "int64")
    x = relax.Var("x", relax.TensorType((b, hidden), dtype))
    cos, sin = (relax.Var(n, relax.TensorType((b, d), dtype)) for n in ("cos", "sin"))
    caches = [relax.Var(n, relax.TensorType((b, heads, length, d), dtype))
              for n in llama_cache_names(config.layers)]
    weights = {k: relax.Var(k, relax.TensorType(s, dtype))
               for k, s in llama_shapes(config).items()}
    bb = relax.BlockBuilder()

    def placed(value, placement):  # emitted, annotated with its placement on the devices
        value = bb.emit(value)
        return value if tensor_parallel == 1 else shard(bb, value, placement, tensor_parallel)

    def rms_norm(v, weight):  # in float32: the mean of squares of 4096 values
        normed = op.nn.rms_norm(op.astype(v, "float32"), op.astype(weight, "float32"),
                                axes=[-1], epsilon=config.rms_eps)
        return bb.emit(op.astype(normed, dtype))

    def rotated(v, cos4, sin4):  # v * cos + rotate_half(v) * sin; rotate_half: (-v2, v1)
        v1 = op.strided_slice(v, axes=[3], begin=[0], end=[d // 2])
        v2 = op.strided_slice(v, axes=[3], begin=[d // 2], end=[d])
        half = op.concat([op.negative(v2), v1], axis=3)
        return op.add(op.multiply(v, cos4), op.multiply(half, sin4))

    def by_heads(product):  # (b, hidden) -> (b, heads, 1, d), each rank its heads
        return placed(op.reshape(product, (b, heads, 1, d)), "S[1]")

    with bb.function("main", [x, cos, sin, *caches, *weights.values()]):
        with bb.dataflow():
            cos4 = bb.emit(op.reshape(cos, (b, 1, 1, d)))  # broadcast over heads
            sin4 = bb.emit(op.reshape(sin, (b, 1, 1, d)))
            h, presents = x, []
            for i in range(config.layers):
                w = {kind: weights[f"{kind}{i}"] for kind in LLAMA_LAYER}
                normed = rms_norm(h, w["attn_norm"])
                q, k, v = (by_heads(placed(op.matmul(normed, w[name]), "S[1]"))
                           for name in ("wq", "wk", "wv"))
                q = placed(rotated(q, cos4, sin4), "S[1]")
                k = placed(rotated(k, cos4, sin4), "S[1]")
                past_k, past_v = (placed(c, "S[1]") for c in caches[2 * i:2 * i + 2])
                pk = placed(op.concat([past_k, k], axis=2), "S[1]")  # (b, heads, past + 1, d)
                pv = placed(op.concat([past_v, v], axis=2), "S[1]")
                presents += [pk, pv]
                scores = bb.emit(op.multiply(
                    op.astype(op.matmul(q, op.permute_dims(pk, [0, 1, 3, 2])), "float32"),
                    relax.const(d ** -0.5, "float32")))  # (b, heads, 1, past + 1)
                probs = bb.emit(op.astype(op.nn.softmax(scores, axis=-1), dtype))
                attn = bb.emit(op.matmul(probs, pv))  # (b, heads, 1, d)
                merged = bb.emit(op.reshape(attn, (b, hidden)))
                h = bb.emit(op.add(h, placed(op.matmul(merged, w["wo"]), "R")))
                normed = rms_norm(h, w["mlp_norm"])
                gate = placed(op.nn.silu(op.matmul(normed, w["w_gate"])), "S[1]")
                up = placed(op.matmul(normed, w["w_up"]), "S[1]")
                swiglu = placed(op.multiply(gate, up), "S[1]")
                h = bb.emit(op.add(h, placed(op.matmul(swiglu, w["w_down"]), "R")))
            normed = rms_norm(h, weights["final_norm"])
            logits = bb.emit(op.matmul(normed, weights["lm_head"]))
            out = bb.emit_output(relax.Tuple([logits, *presents]))
        bb.emit_func_output(out)
    mod = bb.get()
    return with_mesh(mod, tensor_parallel) if tensor_parallel > 1 else mod


def llama_numpy(x, cos, sin, caches, weights, config: LlamaConfig):
    """``llama_decode_step`` in numpy, float64 math: (logits, presents), float64."""

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + config.rms_eps) * g

    def rotate_half(v):
        half = v.shape[-1] // 2
        return np.concatenate([-v[..., half:], v[..., :half]], axis=-1)

    w64 = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    h = np.asarray(x, np.float64)
    batch, heads, d = h.shape[0], config.heads, config.head_dim
    cos4, sin4 = (np.asarray(t, np.float64).reshape(batch, 1, 1, d) for t in (cos, sin))
    presents = []
    for i in range(config.layers):
        w = {kind: w64[f"{kind}{i}"] for kind in LLAMA_LAYER}
        normed = rms(h, w["attn_norm"])
        q, k, v = ((normed @ w[name]).reshape(batch, heads, 1, d) for name in ("wq", "wk", "wv"))
        q, k = (t * cos4 + rotate_half(t) * sin4 for t in (q, k))
        pk = np.concatenate([np.asarray(caches[2 * i], np.float64), k], axis=2)
        pv = np.concatenate([np.asarray(caches[2 * i + 1], np.float64), v], axis=2)
        presents += [pk, pv]
        s = q @ pk.transpose(0, 1, 3, 2) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + (p @ pv).reshape(batch, heads * d) @ w["wo"]
        normed = rms(h, w["mlp_norm"])
        gate = normed @ w["w_gate"]
        h = h + (gate / (1 + np.exp(-gate)) * (normed @ w["w_up"])) @ w["w_down"]
    return rms(h, w64["final_norm"]) @ w64["lm_head"], presents


# The models of tensor parallelism's GPU benchmark (``bench/tensor_parallel.py``), each built
# for one device and for two by ``bench/gpu/build_artifacts.py``: the dims each is built for,
# its dtype. The Llama step at Llama-2-7B's sizes, and GPT-2's sizes at batch 1, where the
# all-reduces weigh more than the split saves.
TENSOR_PARALLEL_PAST_MAX = 1024
TENSOR_PARALLEL_MODELS = {
    "llama_7b": {"dims": {"batch": (1, 8), "past": (1, TENSOR_PARALLEL_PAST_MAX)},
                 "dtype": "float16"},
    "gpt2": {"dims": {"past": (1, TENSOR_PARALLEL_PAST_MAX)}, "dtype": "float32"},
}
GPT2_BENCH = {"hidden": 768, "heads": 12, "layers": 12}


def tensor_parallel_artifact(name: str, world: int) -> str:
    """The file name of benchmark model ``name``'s build for ``world`` devices."""
    return f"tp_{name}.{world}gpu.cuda.grape"


def tensor_parallel_module(name: str, world: int, config: LlamaConfig = LLAMA_7B):
    """Benchmark model ``name`` as a Relax module for ``world`` devices (annotated where
    ``world`` > 1), and its output names. ``config``: the Llama model's sizes."""
    if name == "gpt2":
        return (gpt2_decode_step(**GPT2_BENCH, tensor_parallel=world),
                gpt2_output_names(GPT2_BENCH["layers"]))
    dtype = TENSOR_PARALLEL_MODELS[name]["dtype"]
    return llama_decode_step(config, world, dtype), llama_output_names(config.layers)
