"""The bundled example: a stack of transformer-style MLP blocks over a dynamic length ``n``.

Each block is ``x + gelu(layer_norm(x) @ W + b)``: kernel-launch bound at small ``n``,
the shape of model grape-tvm is for. Weights come from a seed, so the file is reproducible.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def make_blocks(width: int = 64, blocks: int = 4, seed: int = 0, dim: str = "n") -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    const("half", np.array(0.5))
    const("one", np.array(1.0))
    const("inv_sqrt2", np.array(1 / np.sqrt(2.0)))
    x = "x"
    for i in range(blocks):
        p = f"b{i}_"
        scale = const(p + "ln_scale", 1 + 0.1 * rng.standard_normal(width))
        bias = const(p + "ln_bias", 0.1 * rng.standard_normal(width))
        w = const(p + "w", rng.standard_normal((width, width)) / np.sqrt(width))
        b = const(p + "b", 0.1 * rng.standard_normal(width))
        nodes += [
            helper.make_node("LayerNormalization", [x, scale, bias], [p + "ln"], axis=-1, epsilon=1e-5),
            helper.make_node("MatMul", [p + "ln", w], [p + "mm"]),
            helper.make_node("Add", [p + "mm", b], [p + "h"]),
            helper.make_node("Mul", [p + "h", "inv_sqrt2"], [p + "hs"]),
            helper.make_node("Erf", [p + "hs"], [p + "erf"]),
            helper.make_node("Add", [p + "erf", "one"], [p + "erf1"]),
            helper.make_node("Mul", [p + "h", p + "erf1"], [p + "g0"]),
            helper.make_node("Mul", [p + "g0", "half"], [p + "gelu"]),
            helper.make_node("Add", [x, p + "gelu"], [p + "out"]),
        ]
        x = p + "out"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes, "mlp_blocks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", type=Path, default=Path(__file__).with_name("blocks.onnx"))
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    onnx.save(make_blocks(args.width, args.blocks, args.seed), str(args.output))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
