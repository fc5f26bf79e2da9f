"""grape-tvm: dynamic deep neural networks as CUDA graphs, on TVM.

Compile side (needs TVM's compiler)::

    m = grape_tvm.compile_onnx("model.onnx", dims={"seq": (1, 512)}, target="cuda")
    m.export("model.grape")

Deploy side (the TVM runtime is enough)::

    ex = grape_tvm.load("model.grape", device="cuda")
    outs = ex.run({"x": x})

Importing this package loads neither: each entry point imports what it needs, so that a
runtime-only TVM can load artifacts.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["build", "compile_onnx", "compile_loop", "load", "load_loop", "load_onnx_loop",
           "load_tensor_parallel", "grape_pipeline",
           "__version__"]


def __getattr__(name):
    if name in ("build", "compile_loop", "GrapeModule"):
        from grape_tvm import compiler  # pylint: disable=import-outside-toplevel

        return getattr(compiler, name)
    if name == "compile_onnx":
        from grape_tvm.onnx_compiler import compile_onnx  # pylint: disable=import-outside-toplevel

        return compile_onnx
    if name == "grape_pipeline":
        from grape_tvm.pipeline import grape_pipeline  # pylint: disable=import-outside-toplevel

        return grape_pipeline
    if name in ("load_loop", "load_onnx_loop"):
        from grape_tvm import loop  # pylint: disable=import-outside-toplevel

        return getattr(loop, name)
    if name == "load":
        from grape_tvm.loader import load  # pylint: disable=import-outside-toplevel

        return load
    if name == "load_tensor_parallel":
        from grape_tvm.tensor_parallel_session import load_tensor_parallel  # pylint: disable=import-outside-toplevel

        return load_tensor_parallel
    raise AttributeError(f"module 'grape_tvm' has no attribute {name!r}")
