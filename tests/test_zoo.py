"""The model zoo (``bench/zoo``) on the CPU: each architecture exported from its tiny
configuration the way ``bench/zoo/run.py`` ends up exporting it, by the legacy exporter and
by the dynamo exporter, compiled for llvm, and compared with onnxruntime at the range's
smallest and top shapes (a decoder: and its greedy tokens)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import grape_tvm

pytest.importorskip("torch", reason="the zoo exports from PyTorch (torch not installed)")
pytest.importorskip("transformers", reason="the zoo's models are transformers' (not installed)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "zoo"))

from architectures import (  # noqa: E402  pylint: disable=wrong-import-position
    ARCHITECTURES, TOLERANCE, Export, errors_against_onnxruntime, tokens_against_onnxruntime)


def _equals_onnxruntime(arch, how: Export, tmp_path) -> None:
    reference = arch.export(tmp_path / f"{arch.name}.onnx", how)
    executor = grape_tvm.load(grape_tvm.compile_onnx(reference, dims=arch.dims)
                              .export(tmp_path / f"{arch.name}.grape"))
    smallest, _, top = arch.shapes()
    for result in errors_against_onnxruntime(executor, reference, arch, [smallest, top]):
        assert result["relative_error"] <= TOLERANCE, result
    if arch.cache:  # a decoder: its greedy tokens over the whole past range, as onnxruntime's
        tokens = tokens_against_onnxruntime(executor, reference, arch)
        assert tokens["tokens_equal"] and tokens["steps"] >= 32, tokens


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_zoo_model_equals_onnxruntime(name, tmp_path):
    arch = ARCHITECTURES[name]
    _equals_onnxruntime(arch, arch.exports[-1], tmp_path)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_zoo_model_by_the_dynamo_exporter_equals_onnxruntime(name, tmp_path):
    """The same export by ``torch.onnx.export(..., dynamo=True)``: its graphs keep dims as
    scalars where the legacy exporter's keep tensors (``Reshape``/``Add`` of a dim)."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    arch = ARCHITECTURES[name]
    _equals_onnxruntime(arch, replace(arch.exports[-1], dynamo=True), tmp_path)


# onnxruntime's transformer optimizer: its model type for each architecture
ONNXRUNTIME_OPTIMIZED = {"bert": "bert", "vit": "vit", "bart_encoder": "bart",
                         "whisper_decode": "bart", "llama": "gpt2", "llama_decode": "gpt2"}


@pytest.mark.parametrize("name", sorted(ONNXRUNTIME_OPTIMIZED))
def test_zoo_model_fused_by_onnxruntime_equals_onnxruntime(name, tmp_path):
    """The export as onnxruntime's transformer optimizer fuses it (``SkipLayerNormalization``,
    ``SkipSimplifiedLayerNormalization``, ``SimplifiedLayerNormalization``:
    ``grape_tvm/onnx_contrib.py``; ``BiasGelu``: TVM's), against onnxruntime on the unfused
    one."""
    from onnxruntime.transformers import optimizer  # pylint: disable=import-outside-toplevel

    arch = ARCHITECTURES[name]
    reference = arch.export(tmp_path / f"{name}.onnx", arch.exports[-1])
    fused = optimizer.optimize_model(str(reference), model_type=ONNXRUNTIME_OPTIMIZED[name],
                                     opt_level=1, num_heads=0, hidden_size=0)
    assert any(n.domain == "com.microsoft" for n in fused.model.graph.node)
    fused_path = tmp_path / f"{name}.fused.onnx"
    fused.save_model_to_file(str(fused_path))
    executor = grape_tvm.load(grape_tvm.compile_onnx(fused_path, dims=arch.dims)
                              .export(tmp_path / f"{name}.grape"))
    smallest, _, top = arch.shapes()
    for result in errors_against_onnxruntime(executor, reference, arch, [smallest, top]):
        assert result["relative_error"] <= TOLERANCE, result
