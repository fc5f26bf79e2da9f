"""What a compiled model takes: `ShapeRange` of each symbolic dimension, `InputSpec` of each input."""

from __future__ import annotations

import functools
import numbers
import re
from dataclasses import dataclass

import tvm_ffi

MAX_DIM = 2**63 - 1  # the largest shape value TVM (int64) holds


@dataclass(frozen=True)
class ShapeRange:
    """Inclusive range ``lo..hi`` of a symbolic dimension (``seq=1..1024``)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not (isinstance(self.lo, int) and isinstance(self.hi, int)):
            raise TypeError(f"a shape range takes integers, got {self.lo!r}..{self.hi!r}")
        if self.lo < 0 or self.hi < self.lo:
            raise ValueError(f"a shape range needs 0 <= lo <= hi, got {self.lo}..{self.hi}")
        if self.hi > MAX_DIM:
            raise ValueError(f"a shape range's upper bound must be at most 2**63 - 1 (TVM's "
                             f"shape values are int64), got {self.hi}")

    def __contains__(self, value: int) -> bool:
        return self.lo <= value <= self.hi

    def __iter__(self):
        return iter(range(self.lo, self.hi + 1))

    def __len__(self) -> int:
        return self.hi - self.lo + 1

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}"

    @classmethod
    def of(cls, value: "ShapeRange | tuple[int, int] | str", name: str = "dim") -> "ShapeRange":
        """Accept ``ShapeRange``, ``(lo, hi)`` or ``"lo:hi"`` of integers; anything else is a
        ``ValueError`` naming ``name`` (never a silent truncation of 1.5 to 1)."""
        if isinstance(value, ShapeRange):
            return value
        if isinstance(value, str):
            parts = value.split(":")
            if len(parts) != 2 or not all(re.fullmatch(r"\s*-?[0-9]+\s*", p) for p in parts):
                raise ValueError(f"range of dimension {name!r} must be LO:HI, two integers, "
                                 f"got {value!r}")
            bounds = [int(p) for p in parts]
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            # bool is an int to Python, not to a reader of (True, 8)
            if not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in value):
                raise ValueError(f"range of dimension {name!r} takes integers, got {value!r}")
            bounds = [int(b) for b in value]
        else:
            raise ValueError(f"range of dimension {name!r} must be (lo, hi) or 'lo:hi', got "
                             f"{value!r}")
        try:
            return cls(*bounds)
        except ValueError as err:
            raise ValueError(f"range of dimension {name!r}: {err}") from None


class InputError(ValueError):
    """A call's inputs do not match what the model was compiled for."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of a model input or output; a str in ``shape`` is a symbolic dim.

    ``kind`` is "tensor", or "sequence" for an output that is a list of tensors (its
    ``shape`` is then empty: each tensor has its own).
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    kind: str = "tensor"

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "kind": self.kind}

    @classmethod
    def from_json(cls, obj: dict) -> "TensorSpec":
        return cls(obj["name"], obj["dtype"], tuple(obj["shape"]), obj.get("kind", "tensor"))


@dataclass(frozen=True)
class Signature:
    """What a compiled model takes and returns, and the range of each symbolic dimension."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dims: dict[str, ShapeRange]

    def __post_init__(self):
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            names = [t.name for t in specs]
            repeated = sorted({name for name in names if names.count(name) > 1})
            if repeated:  # a call names its inputs and outputs: one tensor a name
                raise ValueError(f"{kind} name(s) {repeated} are given to more than one "
                                 f"{kind}; each {kind} needs a name of its own")

    def to_json(self) -> dict:
        return {
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "dims": {k: [r.lo, r.hi] for k, r in self.dims.items()},
        }

    @classmethod
    def from_json(cls, obj: dict) -> "Signature":
        return cls(
            tuple(TensorSpec.from_json(t) for t in obj["inputs"]),
            tuple(TensorSpec.from_json(t) for t in obj["outputs"]),
            {k: ShapeRange(int(v[0]), int(v[1])) for k, v in obj["dims"].items()},
        )

    def bind(self, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str], *,
             bound: dict[str, int] | None = None, skip=(), partial: bool = False) -> dict[str, int]:
        """Check one call's input shapes and dtypes; return the value of every symbolic dim.

        ``skip`` names inputs checked before (bound once), whose dims ``bound`` holds;
        ``partial`` checks only the inputs given. Raises ``InputError`` naming the input, the
        value and what was expected: before any kernel runs, never a silent pad, truncation
        or cast.
        """
        specs = self._specs
        missing = [] if partial else [n for n in specs if n not in shapes and n not in skip]
        extra = [n for n in shapes if n not in specs]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing input(s) {missing}")
            if extra:
                parts.append(f"unknown input(s) {extra}")
            raise InputError(f"{'; '.join(parts)}: the model takes {list(specs)}")
        values: dict[str, int] = dict(bound or {})
        for name, shape in shapes.items():  # only the inputs passed: bound ones were checked
            spec, shape, dtype = specs[name], tuple(shape), dtypes[name]
            if dtype != spec.dtype:
                raise InputError(f"input {spec.name!r} has dtype {dtype}, expected {spec.dtype}")
            if len(shape) != len(spec.shape):
                raise InputError(
                    f"input {spec.name!r} has rank {len(shape)} (shape {shape}), expected rank "
                    f"{len(spec.shape)} (shape {_fmt(spec.shape)})")
            for axis, (got, want) in enumerate(zip(shape, spec.shape)):
                self._bind_axis(spec, axis, got, want, values)
        return values

    @property
    def _specs(self) -> dict[str, TensorSpec]:
        specs = self.__dict__.get("_spec_index")
        if specs is None:  # frozen dataclass: cache by hand
            specs = {t.name: t for t in self.inputs}
            object.__setattr__(self, "_spec_index", specs)
        return specs

    def _bind_axis(self, spec: TensorSpec, axis: int, got: int, want, values: dict) -> None:
        where = f"input {spec.name!r} axis {axis}"
        if isinstance(want, int):
            if got != want:
                raise InputError(f"{where} is {got}, expected {want} (shape {_fmt(spec.shape)})")
            return
        rng = self.dims.get(want)
        if rng is not None and got not in rng:
            raise InputError(f"{where} (dimension {want!r}) is {got}, outside its declared "
                             f"range {rng}")
        if want in values and values[want] != got:
            raise InputError(f"{where} (dimension {want!r}) is {got}, but another input set "
                             f"{want!r} to {values[want]}")
        values[want] = got


class BoundDims:
    """The dims that inputs bound once (``bind_inputs``) set, by input. Binding an input
    again replaces what it set; a binding must agree with the bound inputs it leaves as
    they are (bound one at a time, a 7-row x beside a 5-row m was taken, and the call
    after read past m)."""

    def __init__(self, by_input: dict[str, dict[str, int]] | None = None,
                 values: dict[str, int] | None = None):
        self._by_input = by_input or {}
        self.values = values or {}  # every bound input's dims, together

    def binding(self, signature: "Signature", shapes: dict[str, tuple[int, ...]],
                dtypes: dict[str, str]) -> "BoundDims":
        """These dims once inputs ``shapes`` and ``dtypes`` are bound too, checked against
        the signature and the other bound inputs (``InputError``)."""
        kept = {dim: value for name, dims in self._by_input.items() if name not in shapes
                for dim, value in dims.items()}
        values = signature.bind(shapes, dtypes, bound=kept, partial=True)
        by_input = {**self._by_input, **{
            name: signature.bind({name: shapes[name]}, {name: dtypes[name]}, partial=True)
            for name in shapes}}
        return BoundDims(by_input, values)


def nbytes(tensor) -> int:
    """Bytes of a dense tensor (TVM, DLPack or numpy), from its shape and dtype."""
    return nbytes_of(tensor.shape, str(tensor.dtype))


def nbytes_of(shape, dtype: str) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (any TVM dtype: bfloat16 and the
    float8 types too, which numpy does not name)."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * _itemsize(dtype)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    parsed = tvm_ffi.dtype(dtype)
    return max(parsed.bits * parsed.lanes // 8, 1)


def _fmt(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"
