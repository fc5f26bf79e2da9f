"""The libraries grape's runtime provides to compiled models. A plan's "libraries" names those
its regions call; a packed function whose name starts with a library's prefix is one of its
kernels, launched inside the graphs like a PrimFunc's."""

from __future__ import annotations

from .attention import DECODE_FUNCTION_PREFIX as DECODE_ATTENTION_PREFIX
from .attention import DECODE_LIBRARY as DECODE_ATTENTION
from .attention import FUNCTION_PREFIX as ATTENTION_PREFIX
from .attention import LIBRARY as ATTENTION
from .cublaslt import FUNCTION_PREFIX as CUBLASLT_PREFIX
from .cublaslt import LIBRARY as CUBLASLT
from .nccl import FUNCTION_PREFIX as NCCL_PREFIX
from .nccl import LIBRARY as NCCL

LIBRARY_PREFIXES = {CUBLASLT: CUBLASLT_PREFIX, ATTENTION: ATTENTION_PREFIX,
                    DECODE_ATTENTION: DECODE_ATTENTION_PREFIX, NCCL: NCCL_PREFIX}


def library_of(function: str) -> str | None:
    """The library whose packed function ``function`` is, or None."""
    for library, prefix in LIBRARY_PREFIXES.items():
        if function.startswith(prefix):
            return library
    return None
