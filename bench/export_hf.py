"""Export Hugging Face GPT-2 and Wav2Vec2 to ONNX with random weights (no downloads).

    python bench/export_hf.py OUTDIR            # GPT-2 124M and Wav2Vec2 base, weightless ONNX
    python bench/export_hf.py OUTDIR --tiny     # the tiny configurations
    python bench/export_hf.py OUTDIR --dtype float16 --models gpt2   # GPT-2 in fp16 (NAME_fp16)
    python bench/export_hf.py --tests           # tiny models WITH weights into tests/data/

Needs torch and transformers (the project's ``zoo`` extra). For every model it writes:

- ``NAME.onnx``: the graph with its weights lifted to graph inputs (no initializer holds a
  model weight), so the file and any artifact compiled from it stay small;
- ``NAME.weights.json``: for each weight input, the ``state_dict()`` key it is read from
  and the transform applied (``"none"`` or ``"transpose"``), plus the model, config and
  seed that recreate the weights (``make_model``).

On the GPU host ``hf_weights(map_path)`` recreates the model from config and seed and
returns ``{input name: array}`` for ``GraphExecutor.bind_inputs``.

Models (dynamic axes named ``batch``, ``seq``, ``past``, ``samples``):

- ``gpt2_prefill``: ``input_ids [batch, seq]`` -> ``logits``, ``present_{i}_{key,value}``.
- ``gpt2_decode``: ``input_ids [batch, 1]``, ``past_{i}_{key,value} [batch, heads, past,
  head_dim]`` -> ``logits [batch, 1, vocab]``, ``present_* [batch, heads, past + 1, head_dim]``.
  Every past position is attended (no padding), position ids start at ``past``.
- ``wav2vec2``: ``input_values [batch, samples]`` -> ``last_hidden_state``.

Exporter: the legacy TorchScript exporter (``dynamo=False``) with constant folding off.
It keeps every parameter as an initializer named by its ``state_dict`` key, which makes the
weight map exact; the dynamo exporter also works for GPT-2 but renames and folds weights
and emits ``Reshape`` on shape values, which TVM's importer needs grape's fixes for.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper

ROOT = Path(__file__).resolve().parents[1]
OPSET = 17

GPT2_TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000, "n_positions": 128,
             "bos_token_id": 0, "eos_token_id": 0}
WAV2VEC2_TINY = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "intermediate_size": 64, "conv_dim": (16,) * 7, "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
}


def perturb_weights(model):
    """Noise (std 0.02) on every parameter of ``model``, in place; returns it."""
    import torch  # pylint: disable=import-outside-toplevel

    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model


DTYPES = ("float32", "float16")


def make_model(kind: str, config: dict[str, Any], seed: int = 0, dtype: str = "float32"):
    """The transformers model ``kind`` ("gpt2" or "wav2vec2") with random weights: the
    config's own initialization under ``torch.manual_seed(seed)``, then noise (std 0.02)
    on every parameter, eval mode; made in fp32, then cast to ``dtype`` (the same weights,
    rounded, in either dtype).

    The noise makes every weight distinct: the exporter merges initializers of equal
    value (all zero biases, all-one norm scales) into one, which would tie inputs that
    trained weights keep apart, and zero biases would hide a wrong weight map.
    """
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(**config)
        cfg._attn_implementation = "eager"  # pylint: disable=protected-access
        model = perturb_weights(transformers.GPT2LMHeadModel(cfg).eval())
    elif kind == "wav2vec2":
        cfg = transformers.Wav2Vec2Config(**config)
        cfg._attn_implementation = "eager"  # pylint: disable=protected-access
        model = perturb_weights(transformers.Wav2Vec2Model(cfg).eval())
    else:
        raise ValueError(f"unknown model kind {kind!r}: expected 'gpt2' or 'wav2vec2'")
    return model.to(getattr(torch, dtype))


def presents(cache) -> list:
    """A transformers ``DynamicCache``'s keys and values, layer by layer (``present_{i}_*``)."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def dynamic_cache(past) -> object:
    """A ``DynamicCache`` holding ``past`` (keys and values, layer by layer), in any
    transformers 5 (older ones take only the legacy tuple form)."""
    from transformers.cache_utils import DynamicCache  # pylint: disable=import-outside-toplevel

    pairs = list(zip(past[0::2], past[1::2]))
    try:
        return DynamicCache(pairs)
    except TypeError:
        return DynamicCache.from_legacy_cache(tuple(pairs))


def returned_cache(out):
    """A model output's cache: ``cache`` from transformers 5.24 on, ``past_key_values``
    before (the GPU host's transformers is older than the build machine's)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def cache_argument(model) -> str:
    """The name a model's forward takes its cache by (``cache`` or, before transformers
    5.24, ``past_key_values``): passed under the other name it would be ignored."""
    import inspect  # pylint: disable=import-outside-toplevel

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def causal_lm_wrappers(model):
    """Prefill and decode-step modules around a transformers causal LM (GPT-2, Llama):
    explicit key and value tensors in and out, ``past_{i}_*`` in, ``present_{i}_*`` out."""
    import torch  # pylint: disable=import-outside-toplevel

    class Prefill(torch.nn.Module):
        """input_ids -> logits and the layers' keys and values."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            out = self.model(input_ids, use_cache=True)
            return (out.logits, *presents(returned_cache(out)))

    class Decode(torch.nn.Module):
        """One token per sequence with an explicit KV cache of ``past`` positions."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, *past):
            out = self.model(input_ids, use_cache=True,
                             **{cache_argument(self.model): dynamic_cache(past)})
            return (out.logits, *presents(returned_cache(out)))

    return Prefill().eval(), Decode().eval()


def seq2seq_decode_wrapper(model, encoder_attention_mask: bool = True):
    """The decode step of a transformers encoder-decoder (BART, Whisper) as a module:
    ``input_ids [batch, 1]``, the encoder's ``encoder_hidden_states``, its
    ``encoder_attention_mask`` (when ``encoder_attention_mask``; Whisper's forward takes
    none) and the self-attention cache ``past_{i}_*`` in; ``logits`` and the self-attention
    ``present_{i}_*`` out. The cross-attention keys and values are computed from the
    encoder states, as the model does on its first step (an empty cross-attention cache)."""
    import torch  # pylint: disable=import-outside-toplevel
    from transformers.cache_utils import (  # pylint: disable=import-outside-toplevel
        DynamicCache, EncoderDecoderCache)

    class Decode(torch.nn.Module):
        """One token per sequence, attending to the encoder states and ``past`` positions."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, encoder_hidden_states, *rest):
            mask, past = (rest[0], rest[1:]) if encoder_attention_mask else (None, rest)
            cache = EncoderDecoderCache(dynamic_cache(past), DynamicCache())
            kwargs = {} if mask is None else {"attention_mask": mask}
            kwargs[cache_argument(self.model)] = cache
            out = self.model(encoder_outputs=(encoder_hidden_states,), decoder_input_ids=input_ids,
                             use_cache=True, **kwargs)
            return (out.logits, *presents(returned_cache(out).self_attention_cache))

    return Decode().eval()


def kv_names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}_{i}_{kv}" for i in range(layers) for kv in ("key", "value")]


def export_onnx(module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
                dynamic_axes: dict, fold_constants: bool = False,
                keep_batch_norms: bool = False) -> onnx.ModelProto:
    """``module`` traced on ``args`` by the legacy exporter, opset ``OPSET``.

    Without ``fold_constants`` every parameter stays an initializer named by its
    ``state_dict`` key. With it, the exporter folds what depends on parameters alone (a
    linear layer's transposed weight becomes an initializer of its own, which
    ``weight_map`` finds by value). ``keep_batch_norms``: batch norms stay
    ``BatchNormalization`` nodes (training mode "preserve" of a module in eval mode), not
    folded into the convolution before them, whose weights then stay the module's own.
    """
    import torch  # pylint: disable=import-outside-toplevel

    mode = torch.onnx.TrainingMode.PRESERVE if keep_batch_norms else torch.onnx.TrainingMode.EVAL
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic_axes, opset_version=OPSET, training=mode,
                          do_constant_folding=fold_constants, dynamo=False)
    return onnx.load(str(path))


def export_gpt2(config: dict[str, Any], seed: int = 0,
                dtype: str = "float32") -> dict[str, onnx.ModelProto]:
    """GPT-2's prefill and decode step, weights embedded as initializers; the weights, KV
    cache and logits in ``dtype``."""
    import torch  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    model = make_model("gpt2", config, seed, dtype)
    cfg = model.config
    layers, heads, head_dim = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
    prefill, decode = causal_lm_wrappers(model)
    kv_axes = {0: "batch", 2: "past"}
    present_axes = {0: "batch", 2: "seq"}
    with tempfile.TemporaryDirectory() as tmp:
        ids = torch.randint(0, cfg.vocab_size, (2, 5))
        pre = export_onnx(prefill, (ids,), Path(tmp, "prefill.onnx"), ["input_ids"],
                      ["logits", *kv_names("present", layers)],
                      {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"},
                       **{n: present_axes for n in kv_names("present", layers)}})
        past = [torch.randn(2, heads, 3, head_dim, dtype=getattr(torch, dtype))
                for _ in range(2 * layers)]
        dec = export_onnx(decode, (ids[:, :1], *past), Path(tmp, "decode.onnx"),
                      ["input_ids", *kv_names("past", layers)],
                      ["logits", *kv_names("present", layers)],
                      {"input_ids": {0: "batch"}, "logits": {0: "batch"},
                       **{n: kv_axes for n in kv_names("past", layers)},
                       **{n: {0: "batch", 2: "past_plus_1"} for n in kv_names("present", layers)}})
    return {"gpt2_prefill": pre, "gpt2_decode": dec}


def export_wav2vec2(config: dict[str, Any], seed: int = 0) -> dict[str, onnx.ModelProto]:
    """Wav2Vec2Model: input_values -> last_hidden_state, weights embedded."""
    import torch  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    model = make_model("wav2vec2", config, seed)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_values):
            return self.model(input_values).last_hidden_state

    with tempfile.TemporaryDirectory() as tmp:
        proto = export_onnx(Encoder().eval(), (torch.randn(1, 16000),), Path(tmp, "w2v.onnx"),
                        ["input_values"], ["last_hidden_state"],
                        {"input_values": {0: "batch", 1: "samples"},
                         "last_hidden_state": {0: "batch", 1: "frames"}})
    return {"wav2vec2": proto}


def weight_map(proto: onnx.ModelProto, state_dict: dict[str, Any]) -> dict[str, dict]:
    """Each initializer that holds a model weight -> ``{"key", "transform"}``.

    By name first (the legacy exporter names parameters by their ``state_dict`` key, the
    wrapper's when ``state_dict`` is the wrapper's, else behind its ``model.`` prefix);
    otherwise by value, exact or transposed (an exporter that folded a transpose). Only
    floating-point values are weights: initializers matching nothing and integer ones
    (shape constants, position ids, which TVM's importer reads) stay in the graph.
    """
    arrays = {k: v.detach().cpu().numpy() for k, v in state_dict.items()
              if v.dtype.is_floating_point}
    found = {}
    for init in proto.graph.initializer:
        value = onnx.numpy_helper.to_array(init)
        # a name is taken only with the value it names: a wrapper's "model.X" might be
        # another key than the inner model's "X"
        name = next((n for n in (init.name, init.name.removeprefix("model."))
                     if n in arrays and np.array_equal(arrays[n], value)), None)
        if name is not None:
            found[init.name] = {"key": name, "transform": "none"}
            continue
        if value.size < 64:
            continue
        for key, array in arrays.items():
            if array.shape == value.shape and np.array_equal(array, value):
                found[init.name] = {"key": key, "transform": "none"}
                break
            if array.ndim == 2 and array.T.shape == value.shape and np.array_equal(array.T, value):
                found[init.name] = {"key": key, "transform": "transpose"}
                break
    return found


def _spec(kind: str, config: dict, seed: int, dtype: str = "float32") -> dict:
    return {"model": kind, "config": config, "seed": seed, "dtype": dtype}


def _write(outdir: Path, name: str, proto: onnx.ModelProto, spec: dict, state_dict,
           embed_weights: bool) -> None:
    from grape_tvm.frontend import initializers_as_inputs  # pylint: disable=import-outside-toplevel

    weights = weight_map(proto, state_dict)
    if not embed_weights:
        proto = initializers_as_inputs(proto, list(weights))
    onnx.save(proto, str(outdir / f"{name}.onnx"))
    (outdir / f"{name}.weights.json").write_text(json.dumps({**spec, "inputs": weights}, indent=1))
    size = (outdir / f"{name}.onnx").stat().st_size
    print(f"{outdir / name}.onnx: {size} bytes, {len(weights)} weight inputs", flush=True)


def export_all(outdir: Path, tiny: bool, embed_weights: bool, seed: int = 0,
               models: tuple[str, ...] = ("gpt2", "wav2vec2"), dtype: str = "float32") -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    suffix = ("_fp16" if dtype == "float16" else "") + ("_tiny" if tiny else "")
    if "gpt2" in models:
        config = GPT2_TINY if tiny else {}
        state = make_model("gpt2", config, seed, dtype).state_dict()
        for name, proto in export_gpt2(config, seed, dtype).items():
            _write(outdir, name + suffix, proto, _spec("gpt2", config, seed, dtype), state,
                   embed_weights)
    if "wav2vec2" in models and dtype != "float32":
        raise ValueError("Wav2Vec2 is exported in float32 only")
    if "wav2vec2" in models:
        config = WAV2VEC2_TINY if tiny else {}
        state = make_model("wav2vec2", config, seed).state_dict()
        for name, proto in export_wav2vec2(config, seed).items():
            _write(outdir, name + suffix, proto, _spec("wav2vec2", config, seed), state,
                   embed_weights)


def hf_weights(map_path: str | Path) -> dict[str, np.ndarray]:
    """The weight inputs a ``NAME.weights.json`` describes, recreated from config and seed:
    ``{input name: array}`` for ``GraphExecutor.bind_inputs``."""
    spec = json.loads(Path(map_path).read_text())
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()}
    model = make_model(spec["model"], config, spec["seed"], spec.get("dtype", "float32"))
    state = model.state_dict()
    return weights_from_state(state, spec["inputs"], str(map_path))


def weights_from_state(state_dict: dict[str, Any], inputs: dict[str, dict],
                       where: str = "weight map") -> dict[str, np.ndarray]:
    """``{input name: array}`` of a ``weight_map`` (``inputs``), read from ``state_dict``."""
    weights = {}
    for name, entry in inputs.items():
        array = state_dict[entry["key"]].detach().cpu().numpy()
        if entry["transform"] == "transpose":
            array = array.T
        elif entry["transform"] != "none":
            raise ValueError(
                f"{where}: input {name!r} has unknown transform {entry['transform']!r}")
        weights[name] = np.ascontiguousarray(array)
    return weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", nargs="?", type=Path, default=ROOT / "build" / "hf")
    parser.add_argument("--tiny", action="store_true", help="the tiny configurations")
    parser.add_argument("--tests", action="store_true",
                        help="tiny models with their weights embedded, into tests/data/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="gpt2,wav2vec2")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="weights and activations (float16: GPT-2 only)")
    args = parser.parse_args(argv)
    models = tuple(args.models.split(","))
    if args.tests:
        export_all(ROOT / "tests" / "data", tiny=True, embed_weights=True, seed=args.seed,
                   models=models, dtype=args.dtype)
    else:
        export_all(args.outdir, tiny=args.tiny, embed_weights=False, seed=args.seed,
                   models=models, dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
