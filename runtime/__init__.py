"""grape-tvm's runtime: what runs a compiled model. It needs the TVM runtime, not its compiler.

- ``GraphExecutor``: runs a call from the compiler's call program (``CallProgram``), each
  region through a backend; TVM's VM runs the entry function of models with host steps.
- ``RegionBackend``: what a backend does (record a region at a shape, replay it).
- ``CpuReplayBackend``: regions recorded per shape from the VM and replayed (the reference).
- ``CudaGraphBackend``: regions captured per shape into CUDA graphs and replayed.
- ``Signature``/``ShapeRange``: what a call may pass, checked before any kernel runs.
"""

from .backend import RegionBackend
from .call_program import CallProgram
from .executor import CallStats, GraphExecutor, default_backend
from .signature import InputError, ShapeRange, Signature, TensorSpec

__all__ = ["CallProgram", "CallStats", "GraphExecutor", "InputError", "RegionBackend",
           "ShapeRange", "Signature", "TensorSpec", "default_backend"]
