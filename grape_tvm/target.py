"""Targets as users write them: ``llvm``, ``cuda`` or a TVM target JSON dict."""

from __future__ import annotations

import json
from typing import Any

import tvm

DEFAULT_CUDA_ARCH = "sm_90"  # the H200 this project is measured on; name another in JSON


def parse_target(target: Any) -> tvm.target.Target:
    """``"llvm"``/``"cpu"``, ``"cuda"`` (sm_90), a JSON string or dict, or a ``Target``."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, str):
        text = target.strip()
        if text in ("llvm", "cpu"):
            return tvm.target.Target({"kind": "llvm"})
        if text == "cuda":
            return tvm.target.Target({"kind": "cuda", "arch": DEFAULT_CUDA_ARCH})
        if text.startswith("{"):
            try:
                target = json.loads(text)
            except ValueError as err:
                raise ValueError(f"target {text!r} is not valid JSON: {err}") from None
        else:
            raise ValueError(f"unknown target {text!r}: expected llvm, cuda or a JSON dict such "
                             'as \'{"kind": "cuda", "arch": "sm_90"}\'')
    if isinstance(target, dict):
        if target.get("kind") not in ("llvm", "cuda"):
            raise ValueError(f"grape-tvm targets llvm or cuda, got kind {target.get('kind')!r}")
        if target["kind"] == "cuda" and "arch" not in target:
            target = {**target, "arch": DEFAULT_CUDA_ARCH}
        return tvm.target.Target(target)
    raise TypeError(f"target must be a string, dict or tvm.target.Target, got {type(target)}")


def target_json(target: tvm.target.Target) -> dict:
    out = {"kind": target.kind.name}
    if "arch" in target.attrs:
        out["arch"] = str(target.attrs["arch"])
    return out
