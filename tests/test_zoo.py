"""The model zoo (``bench/zoo``) on the CPU: each architecture exported from its tiny
configuration the way ``bench/zoo/run.py`` ends up exporting it, compiled for llvm, and
compared with onnxruntime at the range's smallest and top shapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import grape_tvm
from grape_tvm.frontend import ImportError_

pytest.importorskip("torch", reason="the zoo exports from PyTorch (torch not installed)")
pytest.importorskip("transformers", reason="the zoo's models are transformers' (not installed)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "zoo"))

from architectures import (  # noqa: E402  pylint: disable=wrong-import-position
    ARCHITECTURES, TOLERANCE, Export, errors_against_onnxruntime, tokens_against_onnxruntime)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_zoo_model_equals_onnxruntime(name, tmp_path):
    arch = ARCHITECTURES[name]
    reference = tmp_path / f"{name}.onnx"
    compiled = arch.export(reference, arch.exports[-1])
    executor = grape_tvm.load(grape_tvm.compile_onnx(compiled, dims=arch.dims)
                              .export(tmp_path / f"{name}.grape"))
    smallest, _, top = arch.shapes()
    for result in errors_against_onnxruntime(executor, reference, arch, [smallest, top]):
        assert result["relative_error"] <= TOLERANCE, result
    if arch.cache:  # a decoder: its greedy tokens over the whole past range, as onnxruntime's
        tokens = tokens_against_onnxruntime(executor, reference, arch)
        assert tokens["tokens_equal"] and tokens["steps"] >= 32, tokens


@pytest.mark.xfail(raises=ImportError_, strict=True,
                   reason="TVM's ONNX importer: ConstantOfShape of a scalar (shape []) "
                          "in transformers' attention mask")
def test_bert_as_exported_imports(tmp_path):
    """BERT straight from the exporter, before onnxruntime folds its mask's constants:
    when grape imports it, this passes, and the zoo's BERT export needs no folding."""
    arch = ARCHITECTURES["bert"]
    grape_tvm.compile_onnx(arch.export(tmp_path / "bert.onnx", Export("eager")), dims=arch.dims)
