"""The model zoo: architectures users bring, each a Hugging Face configuration with random
weights (no downloads), its ONNX export with dynamic axes, the dims a user would declare,
and the inputs to check it with.

One ``Architecture`` per model, at two sizes (``Size``): ``ARCHITECTURES`` at the tiny
configurations the test suite and ``bench/zoo/run.py`` run on the CPU, ``FULL_ARCHITECTURES``
at the published sizes ``make gpu-artifacts`` builds for the H200 (``bench/zoo/gpu.py``).
Every model is made in fp32 under ``torch.manual_seed(SEED)`` and its parameters perturbed
(``export_hf.perturb_weights``: no two weights equal, no zero bias hiding a wrong one).
Exported by the legacy TorchScript exporter (opset 17, ``export_hf.export_onnx``) or the
dynamo exporter (``Export.dynamo``); weights embedded as initializers (``export``) or
lifted to graph inputs with a map to recreate them on another machine
(``export_weightless``).

Needs torch and transformers (the project's ``zoo`` extra); they are imported when a model
is made, so listing the architectures needs neither.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx.numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export_hf import (  # noqa: E402  pylint: disable=wrong-import-position
    causal_lm_wrappers, export_onnx, kv_names, perturb_weights, seq2seq_decode_wrapper,
    weight_map, weights_from_state)

SEED = 0

# A weightless export keeps small constants only: a floating-point initializer of this many
# elements or more that matches no weight was derived from weights by the exporter, and
# would carry the build machine's values beside the GPU host's recreated weights.
MAX_EMBEDDED_FLOATS = 64
TOLERANCE = 1e-4  # on relative_error: max |grape - onnxruntime| / max |onnxruntime|, fp32
Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class Export:
    """One way to export a model. An architecture lists them in the order a user tries
    them: transformers' defaults first, then the next step when grape refuses the file."""

    attn_implementation: str | None = None  # None: transformers' default (sdpa)
    # torch.export's ONNX exporter (``dynamo=True``, onnxscript) instead of the legacy
    # TorchScript one
    dynamo: bool = False

    def label(self) -> str:
        exporter = ", dynamo exporter" if self.dynamo else ""
        return f"attn_implementation={self.attn_implementation or 'default'}{exporter}"


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
        """Write the exported model, weights embedded, to ``path``; returns ``path``."""
        self._export(self.make_module(how.attn_implementation), path, how.dynamo)
        return path

    def export_weightless(self, path: Path, how: Export) -> dict[str, dict]:
        """Write the exported model to ``path`` with its weights lifted to graph inputs, one
        file for grape and onnxruntime both, and return its weight map (``weight_map``:
        input name -> ``state_dict`` key and transform). ``weights`` recreates the inputs
        from a module made anew from the config and seed, on any machine."""
        # grape's compiler side: not on a GPU host, which has TVM's runtime only
        from grape_tvm.frontend import (  # pylint: disable=import-outside-toplevel
            initializers_as_inputs)

        module = self.make_module(how.attn_implementation)
        self._export(module, path, how.dynamo)
        proto = onnx.load(str(path))
        inputs = weight_map(proto, module.state_dict())
        proto = initializers_as_inputs(proto, list(inputs))
        for init in proto.graph.initializer:
            value = onnx.numpy_helper.to_array(init)
            if value.dtype.kind == "f" and value.size >= MAX_EMBEDDED_FLOATS:
                raise ValueError(
                    f"{self.name}: initializer {init.name!r} {value.shape} matches no weight "
                    "of the module: the exporter derived it from weights, which the file "
                    "would carry")
        onnx.save(proto, str(path))
        return inputs

    def _export(self, module, path: Path, dynamo: bool = False) -> None:
        """Traced on the middle shape: a dim traced at 1 can be baked in as a constant."""
        import torch  # pylint: disable=import-outside-toplevel

        feeds = self.make_feeds(np.random.default_rng(SEED), self.shapes()[1])
        args = tuple(torch.from_numpy(feeds[name]) for name in self.inputs)
        if dynamo:
            self._export_dynamo(module.eval(), args, path)
        else:
            export_onnx(module.eval(), args, path, list(self.inputs), list(self.outputs),
                        self.dynamic_axes, fold_constants=True, keep_batch_norms=True)

    def _export_dynamo(self, module, args: tuple, path: Path) -> None:
        import torch  # pylint: disable=import-outside-toplevel

        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(path), input_names=list(self.inputs),
                              output_names=list(self.outputs), dynamo=True,
                              dynamic_shapes=self._dynamic_shapes(module), external_data=False,
                              verbose=False)

    def _dynamic_shapes(self, module) -> tuple:
        """The dims as ``torch.export`` takes them: a ``Dim`` per named dim with its range,
        shaped like ``module.forward``'s parameters (a ``*args`` takes a tuple)."""
        import inspect  # pylint: disable=import-outside-toplevel

        import torch  # pylint: disable=import-outside-toplevel

        dims = {d: torch.export.Dim(d, min=lo, max=hi) for d, (lo, hi) in self.dims.items()}
        per_input = [{axis: dims[d] for axis, d in self.dynamic_axes.get(name, {}).items()}
                     for name in self.inputs]
        shaped, taken = [], 0
        for param in inspect.signature(module.forward).parameters.values():
            if param.kind is param.VAR_POSITIONAL:
                shaped.append(tuple(per_input[taken:]))
                taken = len(per_input)
            else:
                shaped.append(per_input[taken])
                taken += 1
        return tuple(shaped)


def weights(module, inputs: dict[str, dict]) -> dict[str, np.ndarray]:
    """The weight inputs of an ``Architecture.export_weightless`` file, from ``module``
    (the architecture's, made from the same config and seed)."""
    return weights_from_state(module.state_dict(), inputs)


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


@dataclass(frozen=True)
class Size:
    """The configurations the zoo's models are made at, as transformers' config arguments,
    and the dims declared for them. ``TINY`` runs in the test suite on the CPU; ``FULL`` is
    the published models' size, built by ``make gpu-artifacts`` and run on the H200."""

    name: str
    bert: dict
    vit: dict
    llama: dict
    resnet: dict
    bart: dict
    whisper: dict
    dims: dict[str, dict[str, tuple[int, int]]]  # architecture -> what the user declares

    @property
    def vocab(self) -> int:
        """Token ids are drawn below every text model's vocabulary."""
        return min(c["vocab_size"] for c in (self.bert, self.llama, self.bart, self.whisper))

    @property
    def image(self) -> int:
        """Pixels a side of ViT's and ResNet's images."""
        return self.vit["image_size"]


# the encoder-decoders' special tokens (BART's; Whisper's real ones differ, to no effect here)
_SEQ2SEQ_TOKENS = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                   "decoder_start_token_id": 2}

TINY = Size(
    "tiny",
    bert={"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 128, "max_position_embeddings": 128},
    # 4x4 patches of 8 pixels
    vit={"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 128, "image_size": 32, "patch_size": 8},
    # grouped-query: 4 heads of 16 share 2 key-value heads
    llama={"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128},
    # ResNet-18's shape (basic blocks, four stages) at a tiny width and depth; 32 pixels go
    # down to 1x1
    resnet={"embedding_size": 16, "hidden_sizes": [16, 32, 64, 128], "depths": [1, 1, 1, 1],
            "layer_type": "basic", "num_labels": 10},
    bart={"vocab_size": 1000, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
          "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 128,
          "decoder_ffn_dim": 128, "max_position_embeddings": 128},
    # the encoder: 2 * 16 mel frames of 16 bins in, 16 states out
    whisper={"vocab_size": 1000, "d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
             "encoder_attention_heads": 4, "decoder_attention_heads": 4,
             "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 16,
             "max_source_positions": 16, "max_target_positions": 128},
    dims={"bert": {"batch": (1, 4), "seq": (1, 64)},
          "llama": {"batch": (1, 4), "seq": (1, 64)},
          "llama_decode": {"batch": (1, 4), "past": (1, 64)},
          "vit": {"batch": (1, 8)},
          "resnet": {"batch": (1, 8)},
          "bart_encoder": {"batch": (1, 4), "seq": (1, 64)},
          "bart_decode": {"batch": (1, 4), "past": (1, 64), "source": (1, 48)},
          "whisper_encoder": {"batch": (1, 8)},
          "whisper_decode": {"batch": (1, 4), "past": (1, 64)}},
)

FULL = Size(
    "full",
    bert={"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,  # BERT-base
          "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512},
    vit={"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,  # ViT-B/16
         "intermediate_size": 3072, "image_size": 224, "patch_size": 16},
    # a small Llama (GPT-2 124M's width and depth): RoPE, RMSNorm, SiLU gate, 12 heads of
    # 64 sharing 4 key-value heads
    llama={"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
           "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
           "max_position_embeddings": 2048},
    resnet={"embedding_size": 64, "hidden_sizes": [256, 512, 1024, 2048],  # ResNet-50
            "depths": [3, 4, 6, 3], "layer_type": "bottleneck", "num_labels": 1000},
    bart={"vocab_size": 50265, "d_model": 768, "encoder_layers": 6, "decoder_layers": 6,  # base
          "encoder_attention_heads": 12, "decoder_attention_heads": 12,
          "encoder_ffn_dim": 3072, "decoder_ffn_dim": 3072, "max_position_embeddings": 1024},
    whisper={"vocab_size": 51865, "d_model": 384, "encoder_layers": 4, "decoder_layers": 4,
             "encoder_attention_heads": 6, "decoder_attention_heads": 6,  # Whisper-tiny
             "encoder_ffn_dim": 1536, "decoder_ffn_dim": 1536, "num_mel_bins": 80,
             "max_source_positions": 1500, "max_target_positions": 448},
    dims={"bert": {"batch": (1, 8), "seq": (1, 256)},
          "llama": {"batch": (1, 4), "seq": (1, 256)},
          "llama_decode": {"batch": (1, 4), "past": (1, 512)},
          "vit": {"batch": (1, 8)},
          "resnet": {"batch": (1, 8)},
          "bart_encoder": {"batch": (1, 4), "seq": (1, 256)},
          "bart_decode": {"batch": (1, 4), "past": (1, 256), "source": (1, 256)},
          "whisper_encoder": {"batch": (1, 4)},
          "whisper_decode": {"batch": (1, 4), "past": (1, 256)}},
)


class _Models:
    """The zoo's torch modules at one ``Size``: ``make_module`` functions of each
    architecture (attn_implementation -> module)."""

    def __init__(self, size: Size):
        self.size = size

    def _encoder(self, family: str, config: dict, attn_implementation: str | None):
        """transformers' ``{family}Model`` (Bert, ViT) without its pooler:
        ``last_hidden_state``."""
        import transformers  # pylint: disable=import-outside-toplevel

        cfg = getattr(transformers, f"{family}Config")(**config, **_attn(attn_implementation))
        model_class = getattr(transformers, f"{family}Model")
        return _returning(_seeded(lambda: model_class(cfg, add_pooling_layer=False)),
                          "last_hidden_state")

    def bert(self, attn_implementation: str | None):
        return self._encoder("Bert", self.size.bert, attn_implementation)

    def vit(self, attn_implementation: str | None):
        return self._encoder("ViT", self.size.vit, attn_implementation)

    def _llama(self, attn_implementation: str | None):
        import transformers  # pylint: disable=import-outside-toplevel

        cfg = transformers.LlamaConfig(**self.size.llama, **_attn(attn_implementation))
        return _seeded(lambda: transformers.LlamaForCausalLM(cfg))

    def llama_prefill(self, attn_implementation: str | None):
        # No past is fed and only the logits are returned (the cache the model fills is
        # dead code in the graph). Not use_cache=False: without a cache and a mask,
        # transformers looks for packed sequences with torch.diff, which has no ONNX export.
        return _returning(self._llama(attn_implementation), "logits")

    def llama_decode(self, attn_implementation: str | None):
        return causal_lm_wrappers(self._llama(attn_implementation))[1]

    def resnet(self, _attn_implementation: str | None):
        import transformers  # pylint: disable=import-outside-toplevel

        cfg = transformers.ResNetConfig(**self.size.resnet)
        model = _seeded(lambda: transformers.ResNetForImageClassification(cfg))
        perturb_batch_norm_statistics(model)
        return _returning(model, "logits")

    def _seq2seq(self, family: str, config: dict, attn_implementation: str | None):
        """transformers' ``{family}ForConditionalGeneration`` (Bart, Whisper)."""
        import transformers  # pylint: disable=import-outside-toplevel

        extra = {"begin_suppress_tokens": None} if family == "Whisper" else {}
        cfg = getattr(transformers, f"{family}Config")(
            **config, **_SEQ2SEQ_TOKENS, **extra, **_attn(attn_implementation))
        model_class = getattr(transformers, f"{family}ForConditionalGeneration")
        return _seeded(lambda: model_class(cfg))

    def bart_encoder(self, attn_implementation: str | None):
        model = self._seq2seq("Bart", self.size.bart, attn_implementation)
        return _returning(model.get_encoder(), "last_hidden_state")

    def bart_decode(self, attn_implementation: str | None):
        return seq2seq_decode_wrapper(self._seq2seq("Bart", self.size.bart, attn_implementation))

    def whisper_encoder(self, attn_implementation: str | None):
        model = self._seq2seq("Whisper", self.size.whisper, attn_implementation)
        return _returning(model.get_encoder(), "last_hidden_state")

    def whisper_decode(self, attn_implementation: str | None):
        # Whisper's forward takes no encoder attention mask: every frame is attended
        model = self._seq2seq("Whisper", self.size.whisper, attn_implementation)
        return seq2seq_decode_wrapper(model, encoder_attention_mask=False)


def perturb_batch_norm_statistics(model) -> None:
    """Running means and variances away from 0 and 1, in place: made from the seed like the
    weights, so that a batch norm left out or folded wrongly shows."""
    import torch  # pylint: disable=import-outside-toplevel

    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, norms):
                module.running_mean.add_(torch.randn_like(module.running_mean) * 0.1)
                module.running_var.mul_(1 + torch.rand_like(module.running_var))


class _Feeds:
    """The inputs of each architecture at one ``Size`` and shape, drawn from ``rng``."""

    def __init__(self, size: Size):
        self.size = size
        llama = size.llama
        self.llama_kv = (llama["num_key_value_heads"],
                         llama["hidden_size"] // llama["num_attention_heads"])

    def token_ids(self, rng: np.random.Generator, shape: dict[str, int]) -> np.ndarray:
        return rng.integers(0, self.size.vocab, (shape["batch"], shape["seq"])).astype(np.int64)

    def ids_and_padding_mask(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        """The last sequence padded from its middle on (when there is a middle to pad)."""
        mask = np.ones((shape["batch"], shape["seq"]), np.int64)
        mask[-1, max(1, shape["seq"] // 2):] = 0
        return {"input_ids": self.token_ids(rng, shape), "attention_mask": mask}

    def prompt(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        return {"input_ids": self.token_ids(rng, shape)}

    def _past(self, rng: np.random.Generator, shape: dict[str, int], names: list[str],
              heads: int, head_dim: int) -> Feeds:
        kv_shape = (shape["batch"], heads, shape["past"], head_dim)
        return {name: rng.standard_normal(kv_shape).astype(np.float32) for name in names}

    def _next_token(self, rng: np.random.Generator, shape: dict[str, int]) -> np.ndarray:
        return self.token_ids(rng, {"batch": shape["batch"], "seq": 1})

    def llama_decode_step(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        """One new token per sequence after ``past`` cached positions (every one attended)."""
        names = kv_names("past", self.size.llama["num_hidden_layers"])
        return {"input_ids": self._next_token(rng, shape),
                **self._past(rng, shape, names, *self.llama_kv)}

    def _seq2seq_past(self, rng: np.random.Generator, shape: dict[str, int], config: dict) -> Feeds:
        heads = config["decoder_attention_heads"]
        names = kv_names("past", config["decoder_layers"])
        return self._past(rng, shape, names, heads, config["d_model"] // heads)

    def bart_decode_step(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        """One new token per sequence after ``past`` cached positions, attending to
        ``source`` encoder states of which the last sequence's are padded from their
        middle on."""
        source = self.ids_and_padding_mask(rng, {"batch": shape["batch"], "seq": shape["source"]})
        states = (shape["batch"], shape["source"], self.size.bart["d_model"])
        return {"input_ids": self._next_token(rng, shape),
                "encoder_hidden_states": rng.standard_normal(states).astype(np.float32),
                "encoder_attention_mask": source["attention_mask"],
                **self._seq2seq_past(rng, shape, self.size.bart)}

    def whisper_decode_step(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        """One new token per sequence after ``past`` cached positions, attending to the
        encoder's ``max_source_positions`` states."""
        whisper = self.size.whisper
        states = (shape["batch"], whisper["max_source_positions"], whisper["d_model"])
        return {"input_ids": self._next_token(rng, shape),
                "encoder_hidden_states": rng.standard_normal(states).astype(np.float32),
                **self._seq2seq_past(rng, shape, whisper)}

    def log_mel(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        whisper = self.size.whisper
        frames = 2 * whisper["max_source_positions"]  # the encoder's stride-2 convolution
        return {"input_features": rng.standard_normal(
            (shape["batch"], whisper["num_mel_bins"], frames)).astype(np.float32)}

    def images(self, rng: np.random.Generator, shape: dict[str, int]) -> Feeds:
        image = self.size.image
        return {"pixel_values": rng.standard_normal((shape["batch"], 3, image, image))
                .astype(np.float32)}


_BATCH_SEQ = {0: "batch", 1: "seq"}


def _self_attention_cache(layers: int) -> dict[str, dict[int, str]]:
    return {**{name: {0: "batch", 2: "past"} for name in kv_names("past", layers)},
            **{name: {0: "batch", 2: "past_plus_1"} for name in kv_names("present", layers)}}


def architectures(size: Size) -> dict[str, Architecture]:
    """Every zoo architecture at ``size``, by name."""
    models, feeds, dims = _Models(size), _Feeds(size), size.dims
    llama_layers = size.llama["num_hidden_layers"]
    bart_layers, whisper_layers = size.bart["decoder_layers"], size.whisper["decoder_layers"]
    return {a.name: a for a in [
        Architecture(
            "bert", models.bert, ("input_ids", "attention_mask"), ("last_hidden_state",),
            {"input_ids": _BATCH_SEQ, "attention_mask": _BATCH_SEQ,
             "last_hidden_state": _BATCH_SEQ},
            dims["bert"], feeds.ids_and_padding_mask),
        Architecture(
            "llama", models.llama_prefill, ("input_ids",), ("logits",),
            {"input_ids": _BATCH_SEQ, "logits": _BATCH_SEQ}, dims["llama"], feeds.prompt,
            # sdpa with grouped-query attention has no ONNX export (torch's legacy exporter)
            exports=(Export(), Export("eager"))),
        Architecture(
            "llama_decode", models.llama_decode,
            ("input_ids", *kv_names("past", llama_layers)),
            ("logits", *kv_names("present", llama_layers)),
            {"input_ids": {0: "batch"}, "logits": {0: "batch"},
             **_self_attention_cache(llama_layers)},
            dims["llama_decode"], feeds.llama_decode_step),
        Architecture(
            "vit", models.vit, ("pixel_values",), ("last_hidden_state",),
            {"pixel_values": {0: "batch"}, "last_hidden_state": {0: "batch"}},
            dims["vit"], feeds.images),
        Architecture(
            "resnet", models.resnet, ("pixel_values",), ("logits",),
            {"pixel_values": {0: "batch"}, "logits": {0: "batch"}},
            dims["resnet"], feeds.images),
        Architecture(
            "bart_encoder", models.bart_encoder, ("input_ids", "attention_mask"),
            ("last_hidden_state",),
            {"input_ids": _BATCH_SEQ, "attention_mask": _BATCH_SEQ,
             "last_hidden_state": _BATCH_SEQ},
            dims["bart_encoder"], feeds.ids_and_padding_mask),
        Architecture(
            "bart_decode", models.bart_decode,
            ("input_ids", "encoder_hidden_states", "encoder_attention_mask",
             *kv_names("past", bart_layers)),
            ("logits", *kv_names("present", bart_layers)),
            {"input_ids": {0: "batch"}, "logits": {0: "batch"},
             "encoder_hidden_states": {0: "batch", 1: "source"},
             "encoder_attention_mask": {0: "batch", 1: "source"},
             **_self_attention_cache(bart_layers)},
            dims["bart_decode"], feeds.bart_decode_step),
        Architecture(
            "whisper_encoder", models.whisper_encoder, ("input_features",),
            ("last_hidden_state",),
            {"input_features": {0: "batch"}, "last_hidden_state": {0: "batch"}},
            dims["whisper_encoder"], feeds.log_mel),
        Architecture(
            "whisper_decode", models.whisper_decode,
            ("input_ids", "encoder_hidden_states", *kv_names("past", whisper_layers)),
            ("logits", *kv_names("present", whisper_layers)),
            {"input_ids": {0: "batch"}, "logits": {0: "batch"},
             "encoder_hidden_states": {0: "batch"}, **_self_attention_cache(whisper_layers)},
            dims["whisper_decode"], feeds.whisper_decode_step),
    ]}


ARCHITECTURES = architectures(TINY)  # the test suite's and bench/zoo/run.py's
FULL_ARCHITECTURES = architectures(FULL)  # make gpu-artifacts' and bench/zoo/gpu.py's


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over max |want|: relative to the output's scale, so that elements
    near zero do not blow the measure up."""
    scale = float(np.abs(want).max()) or 1.0
    return float(np.abs(got.astype(np.float64) - want).max()) / scale


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
    present reaches the range's top (the last step's past is one below it). ``run`` maps
    feeds to outputs by name; (batch, steps) tokens."""
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
