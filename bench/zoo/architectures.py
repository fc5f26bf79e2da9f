"""The model zoo: architectures users bring, each a tiny Hugging Face configuration with
random weights (no downloads), its ONNX export with dynamic axes, the dims a user would
declare, and the inputs to check it with.

One ``Architecture`` per model, listed in ``ARCHITECTURES``. Every model is made in fp32
under ``torch.manual_seed(SEED)`` and its parameters perturbed (``export_hf.perturb_weights``:
no two weights equal, no zero bias hiding a wrong one). Exported by ``export_hf.export_onnx``
(the legacy TorchScript exporter, opset 17), weights embedded as initializers.

Needs torch and transformers (not project dependencies); they are imported when a model is
made, so listing the architectures needs neither.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export_hf import (  # noqa: E402  pylint: disable=wrong-import-position
    causal_lm_wrappers, export_onnx, kv_names, perturb_weights, seq2seq_decode_wrapper)

SEED = 0
VOCAB = 1000
LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 2, 2, 16  # grouped-query: 4 heads share 2
IMAGE = 32  # pixels a side: ViT's 4x4 patches of 8, ResNet down to 1x1
# the encoder-decoders (BART, Whisper): 2 + 2 layers, 4 heads of 16
SEQ2SEQ_LAYERS, SEQ2SEQ_HEADS, SEQ2SEQ_HEAD_DIM = 2, 4, 16
SEQ2SEQ_D_MODEL = SEQ2SEQ_HEADS * SEQ2SEQ_HEAD_DIM
MEL_BINS, WHISPER_FRAMES = 16, 16  # Whisper's encoder: 2 * 16 mel frames in, 16 states out

TOLERANCE = 1e-4  # on relative_error: max |grape - onnxruntime| / max |onnxruntime|, fp32
Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Export:
    """One way to export a model. An architecture lists them in the order a user tries
    them: transformers' defaults first, then the next step when grape refuses the file."""

    attn_implementation: str | None = None  # None: transformers' default (sdpa)
    # onnxruntime's basic graph optimizations (constant folding, standard ONNX ops only)
    # rewrite the exported file before grape reads it
    folded_by_onnxruntime: bool = False

    def label(self) -> str:
        folded = ", folded by onnxruntime" if self.folded_by_onnxruntime else ""
        return f"attn_implementation={self.attn_implementation or 'default'}{folded}"


@dataclass(frozen=True)
class Architecture:
    """One zoo model: how to make it, export it, declare its dims and feed it."""

    name: str
    make_module: Callable[[str | None], object]  # attn_implementation -> torch module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    dims: dict[str, tuple[int, int]]  # what the user declares to compile_onnx
    make_feeds: Callable[[np.random.Generator, dict[str, int]], Feeds]
    exports: tuple[Export, ...] = (Export(),)

    def shapes(self) -> list[dict[str, int]]:
        """The range's smallest, a middle and its top: every dim at once."""
        return [{d: lo for d, (lo, _) in self.dims.items()},
                {d: (lo + hi) // 2 for d, (lo, hi) in self.dims.items()},
                {d: hi for d, (_, hi) in self.dims.items()}]

    @property
    def cache(self) -> list[tuple[str, str]]:
        """A decoder's (past input, present output) pairs, in order; empty for the others."""
        past = [n for n in self.inputs if n.startswith("past")]
        present = [n for n in self.outputs if n.startswith("present")]
        return list(zip(past, present))

    def export(self, path: Path, how: Export) -> Path:
        """Write the exported model to ``path`` (the reference onnxruntime runs) and return
        the file grape is to compile: ``path`` itself or its folded copy beside it.

        Traced on the middle shape: a dim traced at 1 can be baked in as a constant."""
        import torch  # pylint: disable=import-outside-toplevel

        feeds = self.make_feeds(np.random.default_rng(SEED), self.shapes()[1])
        args = tuple(torch.from_numpy(feeds[name]) for name in self.inputs)
        export_onnx(self.make_module(how.attn_implementation).eval(), args, path,
                    list(self.inputs), list(self.outputs), self.dynamic_axes)
        if not how.folded_by_onnxruntime:
            return path
        return fold_by_onnxruntime(path, path.with_suffix(".folded.onnx"))


def fold_by_onnxruntime(path: Path, folded: Path) -> Path:
    """``path`` as onnxruntime's basic level optimizes it, saved to ``folded``."""
    import onnxruntime  # pylint: disable=import-outside-toplevel

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(folded)
    onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return folded


def _seeded(make: Callable[[], object]):
    import torch  # pylint: disable=import-outside-toplevel

    torch.manual_seed(SEED)
    return perturb_weights(make().eval())


def _attn(attn_implementation: str | None) -> dict:
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def _returning(model, output: str, **call_kwargs):
    """``model`` as a torch module whose traced graph returns its one ``output``."""
    import torch  # pylint: disable=import-outside-toplevel

    class OneOutput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            return getattr(self.model(*args, **call_kwargs), output)

    return OneOutput()


def _encoder(family: str, attn_implementation: str | None, **config):
    """transformers' ``{family}Model`` (Bert, ViT) at the zoo's tiny encoder size, without
    its pooler: ``last_hidden_state``."""
    import transformers  # pylint: disable=import-outside-toplevel

    cfg = getattr(transformers, f"{family}Config")(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        **config, **_attn(attn_implementation))
    model_class = getattr(transformers, f"{family}Model")
    return _returning(_seeded(lambda: model_class(cfg, add_pooling_layer=False)),
                      "last_hidden_state")


def _bert(attn_implementation: str | None):
    return _encoder("Bert", attn_implementation, vocab_size=VOCAB, max_position_embeddings=128)


def _vit(attn_implementation: str | None):
    return _encoder("ViT", attn_implementation, image_size=IMAGE, patch_size=8)


def _llama_model(attn_implementation: str | None):
    import transformers  # pylint: disable=import-outside-toplevel

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=LLAMA_LAYERS, num_attention_heads=4,
                                   num_key_value_heads=LLAMA_KV_HEADS,
                                   max_position_embeddings=128, **_attn(attn_implementation))
    return _seeded(lambda: transformers.LlamaForCausalLM(cfg))


def _llama_prefill(attn_implementation: str | None):
    # No past is fed and only the logits are returned (the cache the model fills is dead
    # code in the graph). Not use_cache=False: without a cache and a mask, transformers
    # looks for packed sequences with torch.diff, which has no ONNX export.
    return _returning(_llama_model(attn_implementation), "logits")


def _llama_decode(attn_implementation: str | None):
    return causal_lm_wrappers(_llama_model(attn_implementation))[1]


def _resnet(_attn_implementation: str | None):
    import transformers  # pylint: disable=import-outside-toplevel

    # ResNet-18's shape (basic blocks, four stages) at a tiny width and depth
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                    depths=[1, 1, 1, 1], layer_type="basic", num_labels=10)
    model = _seeded(lambda: transformers.ResNetForImageClassification(cfg))
    return _returning(model, "logits")


def _seq2seq_config(family: str, attn_implementation: str | None, **config):
    """transformers' ``{family}Config`` (Bart, Whisper) at the zoo's tiny encoder-decoder
    size."""
    import transformers  # pylint: disable=import-outside-toplevel

    return getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, d_model=SEQ2SEQ_D_MODEL, encoder_layers=SEQ2SEQ_LAYERS,
        decoder_layers=SEQ2SEQ_LAYERS, encoder_attention_heads=SEQ2SEQ_HEADS,
        decoder_attention_heads=SEQ2SEQ_HEADS, encoder_ffn_dim=128, decoder_ffn_dim=128,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        **config, **_attn(attn_implementation))


def _bart_model(attn_implementation: str | None):
    import transformers  # pylint: disable=import-outside-toplevel

    cfg = _seq2seq_config("Bart", attn_implementation, max_position_embeddings=128)
    return _seeded(lambda: transformers.BartForConditionalGeneration(cfg))


def _bart_encoder(attn_implementation: str | None):
    return _returning(_bart_model(attn_implementation).get_encoder(), "last_hidden_state")


def _bart_decode(attn_implementation: str | None):
    return seq2seq_decode_wrapper(_bart_model(attn_implementation))


def _whisper_model(attn_implementation: str | None):
    import transformers  # pylint: disable=import-outside-toplevel

    cfg = _seq2seq_config("Whisper", attn_implementation, num_mel_bins=MEL_BINS,
                          max_source_positions=WHISPER_FRAMES, max_target_positions=128,
                          begin_suppress_tokens=None)
    return _seeded(lambda: transformers.WhisperForConditionalGeneration(cfg))


def _whisper_encoder(attn_implementation: str | None):
    return _returning(_whisper_model(attn_implementation).get_encoder(), "last_hidden_state")


def _whisper_decode(attn_implementation: str | None):
    # Whisper's forward takes no encoder attention mask: every frame is attended
    return seq2seq_decode_wrapper(_whisper_model(attn_implementation),
                                  encoder_attention_mask=False)


def _token_ids(rng: np.random.Generator, shape: dict[str, int]) -> np.ndarray:
    return rng.integers(0, VOCAB, (shape["batch"], shape["seq"])).astype(np.int64)


def _ids_and_padding_mask(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    """The last sequence padded from its middle on (when there is a middle to pad)."""
    mask = np.ones((shape["batch"], shape["seq"]), np.int64)
    mask[-1, max(1, shape["seq"] // 2):] = 0
    return {"input_ids": _token_ids(rng, shape), "attention_mask": mask}


def _decode_step(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    """One new token per sequence after ``past`` cached positions (every one attended)."""
    kv_shape = (shape["batch"], LLAMA_KV_HEADS, shape["past"], LLAMA_HEAD_DIM)
    return {"input_ids": _token_ids(rng, {"batch": shape["batch"], "seq": 1}),
            **{name: rng.standard_normal(kv_shape).astype(np.float32) for name in _PAST}}


def _seq2seq_past(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    kv_shape = (shape["batch"], SEQ2SEQ_HEADS, shape["past"], SEQ2SEQ_HEAD_DIM)
    return {name: rng.standard_normal(kv_shape).astype(np.float32) for name in _SEQ2SEQ_PAST}


def _bart_decode_step(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    """One new token per sequence after ``past`` cached positions, attending to ``source``
    encoder states of which the last sequence's are padded from their middle on."""
    source = _ids_and_padding_mask(rng, {"batch": shape["batch"], "seq": shape["source"]})
    states = (shape["batch"], shape["source"], SEQ2SEQ_D_MODEL)
    return {"input_ids": _token_ids(rng, {"batch": shape["batch"], "seq": 1}),
            "encoder_hidden_states": rng.standard_normal(states).astype(np.float32),
            "encoder_attention_mask": source["attention_mask"],
            **_seq2seq_past(rng, shape)}


def _whisper_decode_step(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    """One new token per sequence after ``past`` cached positions, attending to the
    encoder's ``WHISPER_FRAMES`` states."""
    states = (shape["batch"], WHISPER_FRAMES, SEQ2SEQ_D_MODEL)
    return {"input_ids": _token_ids(rng, {"batch": shape["batch"], "seq": 1}),
            "encoder_hidden_states": rng.standard_normal(states).astype(np.float32),
            **_seq2seq_past(rng, shape)}


def _log_mel(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    return {"input_features": rng.standard_normal((shape["batch"], MEL_BINS, 2 * WHISPER_FRAMES))
            .astype(np.float32)}


def _images(rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
    return {"pixel_values": rng.standard_normal((shape["batch"], 3, IMAGE, IMAGE))
            .astype(np.float32)}


_BATCH_SEQ = {0: "batch", 1: "seq"}
_PAST, _PRESENT = kv_names("past", LLAMA_LAYERS), kv_names("present", LLAMA_LAYERS)
_FOLDED_EAGER = (Export(), Export("eager"), Export("eager", folded_by_onnxruntime=True))
_SEQ2SEQ_PAST = kv_names("past", SEQ2SEQ_LAYERS)
_SEQ2SEQ_PRESENT = kv_names("present", SEQ2SEQ_LAYERS)
_SELF_ATTENTION_CACHE = {**{name: {0: "batch", 2: "past"} for name in _SEQ2SEQ_PAST},
                         **{name: {0: "batch", 2: "past_plus_1"} for name in _SEQ2SEQ_PRESENT}}

ARCHITECTURES = {a.name: a for a in [
    Architecture(
        "bert", _bert, ("input_ids", "attention_mask"), ("last_hidden_state",),
        {"input_ids": _BATCH_SEQ, "attention_mask": _BATCH_SEQ, "last_hidden_state": _BATCH_SEQ},
        {"batch": (1, 4), "seq": (1, 64)}, _ids_and_padding_mask,
        # The mask's scalar ConstantOfShape stops TVM's importer, with either attention;
        # onnxruntime's constant folding removes it
        exports=(Export(), Export("eager"), Export("eager", folded_by_onnxruntime=True))),
    Architecture(
        "llama", _llama_prefill, ("input_ids",), ("logits",),
        {"input_ids": _BATCH_SEQ, "logits": _BATCH_SEQ},
        {"batch": (1, 4), "seq": (1, 64)}, lambda rng, shape: {"input_ids": _token_ids(rng, shape)},
        # sdpa with grouped-query attention has no ONNX export (torch's legacy exporter)
        exports=(Export(), Export("eager"))),
    Architecture(
        "llama_decode", _llama_decode, ("input_ids", *_PAST), ("logits", *_PRESENT),
        {"input_ids": {0: "batch"}, "logits": {0: "batch"},
         **{name: {0: "batch", 2: "past"} for name in _PAST},
         **{name: {0: "batch", 2: "past_plus_1"} for name in _PRESENT}},
        {"batch": (1, 4), "past": (1, 64)}, _decode_step),
    Architecture(
        "vit", _vit, ("pixel_values",), ("last_hidden_state",),
        {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}},
        {"batch": (1, 8)}, _images),
    Architecture(
        "resnet", _resnet, ("pixel_values",), ("logits",),
        {"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
        {"batch": (1, 8)}, _images),
    Architecture(
        "bart_encoder", _bart_encoder, ("input_ids", "attention_mask"), ("last_hidden_state",),
        {"input_ids": _BATCH_SEQ, "attention_mask": _BATCH_SEQ, "last_hidden_state": _BATCH_SEQ},
        {"batch": (1, 4), "seq": (1, 64)}, _ids_and_padding_mask,
        # As BERT's: the mask's scalar ConstantOfShape stops TVM's importer, with either
        # attention; onnxruntime's constant folding removes it (folded, sdpa's attention
        # leaves a Concat of shape values TVM's importer refuses)
        exports=_FOLDED_EAGER),
    Architecture(
        "bart_decode", _bart_decode,
        ("input_ids", "encoder_hidden_states", "encoder_attention_mask", *_SEQ2SEQ_PAST),
        ("logits", *_SEQ2SEQ_PRESENT),
        {"input_ids": {0: "batch"}, "logits": {0: "batch"},
         "encoder_hidden_states": {0: "batch", 1: "source"},
         "encoder_attention_mask": {0: "batch", 1: "source"}, **_SELF_ATTENTION_CACHE},
        {"batch": (1, 4), "past": (1, 64), "source": (1, 48)}, _bart_decode_step,
        # the encoder mask's ConstantOfShape, as the encoder's
        exports=_FOLDED_EAGER),
    Architecture(
        "whisper_encoder", _whisper_encoder, ("input_features",), ("last_hidden_state",),
        {"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}},
        {"batch": (1, 8)}, _log_mel),
    Architecture(
        "whisper_decode", _whisper_decode,
        ("input_ids", "encoder_hidden_states", *_SEQ2SEQ_PAST), ("logits", *_SEQ2SEQ_PRESENT),
        {"input_ids": {0: "batch"}, "logits": {0: "batch"},
         "encoder_hidden_states": {0: "batch"}, **_SELF_ATTENTION_CACHE},
        {"batch": (1, 4), "past": (1, 64)}, _whisper_decode_step),
]}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over max |want|: relative to the output's scale, so that elements
    near zero do not blow the measure up."""
    scale = float(np.abs(want).max()) or 1.0
    return float(np.abs(got.astype(np.float64) - want).max()) / scale


def weights_fingerprint(module) -> str:
    """sha256 of a torch module's parameters and buffers, in ``state_dict`` order: whether
    two machines made the same weights from the seed (torch and transformers versions
    differ between the build machine and the GPU host)."""
    import hashlib  # pylint: disable=import-outside-toplevel

    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def relative_errors(got: dict, want: dict, names) -> float:
    """The worst ``relative_error`` over the outputs ``names``."""
    return max(relative_error(np.asarray(got[name]), np.asarray(want[name])) for name in names)


def errors_against_onnxruntime(executor, path: Path, arch: Architecture,
                               shapes: list[dict[str, int]]) -> list[dict]:
    """Run ``executor`` and onnxruntime (CPU) on the same seeded feeds at each shape:
    ``{"shape", "relative_error"}`` per shape, the worst over the outputs."""
    import onnxruntime  # pylint: disable=import-outside-toplevel

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(SEED)
    results = []
    for shape in shapes:
        feeds = arch.make_feeds(rng, shape)
        got = executor.run(feeds)
        want = dict(zip(arch.outputs, session.run(list(arch.outputs), feeds)))
        results.append({"shape": shape, "relative_error": max(
            relative_error(got[name], want[name]) for name in arch.outputs)})
    return results


def greedy_tokens(run: Callable[[Feeds], dict], arch: Architecture, batch: int = 2) -> np.ndarray:
    """A decoder's greedy generation from the seeded feeds at the smallest past: each step's
    argmax token the next ``input_ids``, its present caches the next past, until the
    present reaches the range's top (the last step's past is one below it). ``run`` maps feeds to outputs by name; (batch, steps) tokens."""
    shape = {**arch.shapes()[0], "batch": batch}
    feeds = arch.make_feeds(np.random.default_rng(SEED), shape)
    steps = arch.dims["past"][1] - shape["past"]
    tokens = []
    for _ in range(steps):
        outputs = run(feeds)
        token = np.asarray(outputs["logits"])[:, -1, :].argmax(-1)
        tokens.append(token)
        feeds = {**feeds, "input_ids": token.reshape(-1, 1).astype(np.int64),
                 **{past: np.asarray(outputs[present]) for past, present in arch.cache}}
    return np.stack(tokens, axis=1)


def tokens_against_onnxruntime(executor, path: Path, arch: Architecture) -> dict:
    """``greedy_tokens`` by ``executor`` and by onnxruntime (CPU) on ``path``: equal or not,
    and from which step they part."""
    import onnxruntime  # pylint: disable=import-outside-toplevel

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = greedy_tokens(lambda f: dict(zip(arch.outputs, session.run(list(arch.outputs), f))),
                         arch)
    got = greedy_tokens(executor.run, arch)
    differ = np.nonzero((got != want).any(axis=0))[0]
    return {"steps": int(want.shape[1]), "batch": int(want.shape[0]),
            "tokens_equal": bool(differ.size == 0),
            "first_differing_step": int(differ[0]) if differ.size else None}
