"""grape-tvm's runtime: what runs a compiled model. It needs the TVM runtime, not its compiler.

- ``GraphExecutor``: runs the host program on TVM's VM and each region through a backend.
- ``CpuReplayBackend``: regions recorded per shape from the VM and replayed (the reference).
- ``CudaGraphBackend``: regions captured per shape into CUDA graphs and replayed.
- ``Signature``/``ShapeRange``: what a call may pass, checked before any kernel runs.
"""

from .executor import CallStats, GraphExecutor, default_backend
from .signature import InputError, ShapeRange, Signature, TensorSpec

__all__ = ["CallStats", "GraphExecutor", "InputError", "ShapeRange", "Signature", "TensorSpec",
           "default_backend"]
