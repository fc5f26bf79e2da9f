"""Attention, ``softmax(q @ k^T * scale + bias) @ v``, as one call of grape's fused attention
kernel, or of its decode attention kernel for a few query rows (``runtime/attention.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import IRModule, relax, tirx
from tvm.sym import Analyzer
from tvm.ir import GenericConst, Op, PrimType
from tvm.ir.transform import PassContext, module_pass

from grape_tvm.runtime.attention import (ALIGN_ELEMENTS, DECODE_DTYPES, DECODE_ROWS, DTYPES,
                                         HEAD_DIMS, AttentionFunction, AttentionLayout,
                                         ViewLayout)

from .var_reads import emit_as, read_counts

_OPS = {name: Op.get(f"relax.{name}") for name in (
    "matmul", "nn.softmax", "add", "multiply", "divide", "permute_dims", "strided_slice", "reshape",
    "concat", "where", "less_equal", "expand_dims", "arange", "broadcast_to")}
_HEADS_AND_ROWS = [0, 2, 1, 3]  # [b, h, r, d] <-> [b, r, h, d]
_LAST_TWO = [0, 1, 3, 2]  # k -> k^T
# A masked score at most this (a large negative bias): its probability is 0 in fp32, as
# in the model's fp16 softmax, so a causal mask of it is the kernel's causal mode.
_MASKED = -1.0e4
# A decode step's cache append (k, v = concat(past, new)) written by the attention's call
# (``_CacheAppend``); off, the concats stay kernels of their own (the benchmarks' A/B:
# ``build_decode_variants``' ``separate_append`` in bench/gpu/build_artifacts.py).
APPEND_TO_CACHES = True
# A score replaced by at most this (``where(keep, s, fill)``) is as well added to it: fp32
# rounds s + fill to fill for any |s| below 3.8e22, so the two softmaxes agree exactly.
_OVERWHELMING = -1.0e30


def _static(expr) -> int | None:
    return int(expr) if isinstance(expr, tirx.IntImm) else None


def _dims(expr: relax.Expr) -> list | None:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    return list(ty.shape.values)


def _scalar(expr: relax.Expr) -> float | None:
    if isinstance(expr, GenericConst) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


@dataclass(frozen=True)
class _View:
    """A [batch, heads, rows, head_dim] operand as a tensor and where its rows lie in it."""

    tensor: relax.Expr
    layout: ViewLayout


@dataclass(frozen=True)
class _Scores:
    """What an attention's probabilities are computed from: softmax(q @ k^T * scale + bias)."""

    q: relax.Expr
    k: relax.Expr  # as stored, [b, h, t, d]
    k_transposed: relax.Expr  # what the product reads: permute_dims(k)
    scale: float
    bias: "relax.Expr | _KeyMask | None"


@dataclass(frozen=True)
class _CacheAppend:
    """k and v as ``concat([past, new], axis=2)`` (a decode step's present caches, GPT-2's
    export): the decode kernel reads past and new where they are and writes the presents."""

    k_present: relax.Var
    v_present: relax.Var
    k_past: relax.Expr
    k_new: relax.Expr
    v_past: relax.Expr
    v_new: relax.Expr


@dataclass(frozen=True)
class _KeyMask:
    """Scores replaced by ``fill`` where ``keep`` is false: the bias ``where(keep, 0, fill)``,
    made once the attention is known to fuse."""

    keep: relax.Expr
    fill: float


@relax.expr_functor.mutator
class _Fuser(relax.PyExprMutator):
    def __init__(self, mod: IRModule):
        super().__init__(mod)
        self.reads: dict[relax.Var, int] = {}
        self.block_vars: set[relax.Var] = set()  # bound in this block, before and after rewrite
        self.gone: set[relax.Var] = set()  # dataflow variables of the blocks before this one
        self.mask_biases: dict[tuple, relax.Var] = {}  # _KeyMask's bias, made once a block
        self.transposed: set[relax.Var] = set()  # ``_transposed_once``
        # Where each binding of the function is, and the bindings reading each variable
        # (``_binding_order``): a cache append fuses only where the presents are read after
        # the attention.
        self.order: dict[relax.Var, int] = {}
        self.readers: dict[relax.Var, list[relax.Var | None]] = {}
        self.binding: relax.Var | None = None  # the binding being visited
        self.analyzer = Analyzer()
        self.fused = 0

    # -- walking back through bindings ------------------------------------------------------
    def _value(self, expr: relax.Expr) -> relax.Expr:
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                return bound
        return expr

    def _call(self, expr: relax.Expr, *names: str) -> relax.Call | None:
        value = self._value(expr)
        if isinstance(value, relax.Call) and any(value.op == _OPS[n] for n in names):
            return value
        return None

    def _once(self, expr: relax.Expr) -> bool:
        """Read by one binding only: fused away, nothing else needs it."""
        return isinstance(expr, relax.Var) and self.reads.get(expr, 0) == 1

    # -- operands ---------------------------------------------------------------------------
    def _view(self, expr: relax.Expr) -> _View:
        """``expr`` ([b, h, r, d]) as a strided view of a tensor it is a view of: a transpose
        of a [b, r, heads, d] tensor, maybe of a slice of its heads (GPT-2's q, k and v out
        of its qkv product), reshapes of a slice of a [b, C] tensor's columns
        (``_columns``), else itself, dense."""
        b, h, r, d = _dims(expr)
        single = self._call(expr, "concat")
        if single is not None and isinstance(single.args[0], relax.Tuple) and \
                len(single.args[0].fields) == 1:
            return self._view(single.args[0].fields[0])
        perm = self._call(expr, "permute_dims")
        if perm is not None and _permutes(perm, _HEADS_AND_ROWS):
            source, first = perm.args[0], 0
            sliced = self._call(source, "strided_slice")
            if sliced is not None and self._sliced_heads(sliced, h) is not None:
                source, first = sliced.args[0], self._sliced_heads(sliced, h)
            dims = _dims(source)
            if dims is not None and len(dims) == 4 and _static(dims[2]) is not None and \
                    all(self.analyzer.can_prove_equal(x, y)
                        for x, y in ((dims[0], b), (dims[1], r), (dims[3], d))):
                row = dims[2] * d
                return _View(source, ViewLayout(first * d, r * row, d, row))
        columns = self._columns(expr, b, h * r * d)
        if columns is not None:
            source, first, width = columns
            return _View(source, ViewLayout(first, width, r * d, d))
        return _View(expr, ViewLayout(0, h * r * d, r * d, d))

    def _columns(self, expr: relax.Expr, batch, width) -> tuple | None:
        """``expr`` as reshapes of a slice of ``width`` columns of a [batch, C] tensor (a
        decoder's q out of its qkv product, reshaped to heads): the tensor, the first column
        and C, else None. A reshape keeps the elements' order, so row b of the slice is
        batch b of ``expr``."""
        while (reshaped := self._call(expr, "reshape")) is not None:
            expr = reshaped.args[0]
        sliced = self._call(expr, "strided_slice")
        if sliced is None:
            return None
        source = _dims(sliced.args[0])
        axes, begin, end = (c.fields for c in sliced.args[1:4])
        steps = sliced.args[4].fields if len(sliced.args) > 4 else []
        if source is None or len(source) != 2 or _static(source[1]) is None or \
                [_static(a) for a in axes] not in ([1], [-1]) or \
                any(_static(x) != 1 for x in steps) or \
                not self.analyzer.can_prove_equal(source[0], batch):
            return None
        first, last = _static(begin[0]), _static(end[0])
        if first is None or last is None or first < 0 or \
                last > _static(source[1]) or _static(width) != last - first:
            return None
        return sliced.args[0], first, _static(source[1])

    @staticmethod
    def _sliced_heads(call: relax.Call, heads) -> int | None:
        """The first of the ``heads`` heads a slice of axis 2 with unit steps takes (its axes,
        begins, ends and steps are tuples of dims; a negative begin counts from the end),
        else None."""
        axes, begin = call.args[1], call.args[2]
        steps = call.args[4].fields if len(call.args) > 4 else []
        source = _dims(call.args[0])
        if [_static(a) for a in axes.fields] != [2] or any(_static(s) != 1 for s in steps) or \
                source is None or _static(source[2]) is None or _static(begin.fields[0]) is None:
            return None
        first = _static(begin.fields[0])
        first += _static(source[2]) if first < 0 else 0
        return first if 0 <= first and first + _static(heads) <= _static(source[2]) else None

    def _aligned(self, view: ViewLayout) -> bool:
        return all(self.analyzer.can_prove_equal(tirx.floormod(tirx.const(0, "int64") + x,
                                                               ALIGN_ELEMENTS), 0)
                   for x in (view.offset, view.batch, view.head, view.row))

    # -- the mask ---------------------------------------------------------------------------
    def _index_along(self, expr: relax.Expr, axis: int) -> relax.Expr | None:
        """The length n of ``arange(0, n)`` that ``expr`` holds along ``axis`` of a rank-4
        broadcast (every other dim 1), through ``expand_dims``."""
        dims = _dims(expr)
        while True:
            value = self._value(expr)
            if isinstance(value, relax.Call) and value.op == _OPS["expand_dims"]:
                expr = value.args[0]
                continue
            break
        if not isinstance(value, relax.Call) or value.op != _OPS["arange"] or dims is None:
            return None
        start, end, step = value.args
        if _scalar_prim(start) != 0 or _scalar_prim(step) != 1:
            return None
        dims = [1] * (4 - len(dims)) + dims
        if any(_static(d) != 1 for i, d in enumerate(dims) if i != axis):
            return None
        return _prim(end)

    def _causal(self, bias: relax.Expr, rows, keys) -> bool:
        """``bias`` is ``where(key <= query, 0, masked)`` of aranges over the rows and keys,
        with as many keys as rows: key j attended from row i iff j <= i."""
        where = self._call(bias, "where")
        if where is None:
            return False
        cond, kept, masked = where.args
        if _scalar(kept) != 0.0 or (_scalar(masked) or 0.0) > _MASKED:
            return False
        broadcast = self._call(cond, "broadcast_to")
        compare = self._call(broadcast.args[0] if broadcast is not None else cond, "less_equal")
        if compare is None:
            return False
        key_count = self._index_along(compare.args[0], 3)
        row_count = self._index_along(compare.args[1], 2)
        return key_count is not None and row_count is not None and all(
            self.analyzer.can_prove_equal(a, b) for a, b in ((key_count, keys),
                                                             (row_count, rows), (rows, keys)))

    def _bias_layout(self, shape: list | None, dims: list) -> ViewLayout | None:
        """A bias of ``shape`` broadcast to [b, h, r, t] read in place: stride 0 on its dims
        of 1."""
        if shape is None or len(shape) > 4:
            return None
        shape = [tirx.const(1, "int64")] * (4 - len(shape)) + shape
        strides, stride = [], tirx.const(1, "int64")
        for extent, want in reversed(list(zip(shape, dims))):
            if _static(extent) == 1 and _static(want) != 1:
                strides.append(0)
            elif self.analyzer.can_prove_equal(extent, want):
                strides.append(stride)
            else:
                return None
            stride = stride * extent
        batch, head, row, key = reversed(strides)
        return ViewLayout(0, batch, head, row) if _static(key) == 1 else None

    # -- the rewrite ------------------------------------------------------------------------
    def _scores(self, product: relax.Call) -> _Scores | None:
        """``product``'s ``softmax(q @ k^T * scale + bias)``, every value between read once
        (fused away), or None."""
        probs = self._call(product.args[0], "nn.softmax")
        if probs is None or not self._once(product.args[0]) or \
                int(probs.attrs.axis) not in (-1, 3):
            return None
        scores, bias = probs.args[0], None
        if not self._once(scores):
            return None
        masked = self._call(scores, "where")
        if masked is not None:
            keep, kept, fill = masked.args
            value = _scalar(fill)
            if value is None or value > _OVERWHELMING or not self._once(kept):
                return None
            scores, bias = kept, _KeyMask(keep, value)
        added = None if bias is not None else self._call(scores, "add")
        if added is not None:
            x, y = added.args
            scaled_first = self._call(x, "matmul", "multiply", "divide") is not None
            scores, bias = (x, y) if scaled_first else (y, x)
            if not self._once(scores):
                return None
        scale = 1.0
        scaled = self._call(scores, "multiply", "divide")
        if scaled is not None:
            x, y = scaled.args
            if scaled.op == _OPS["multiply"] and _scalar(y) is None:
                x, y = y, x  # the constant second
            factor = _scalar(y)
            if factor is None or factor == 0.0 or not self._once(x):
                return None
            scores, scale = x, (1.0 / factor if scaled.op == _OPS["divide"] else factor)
        qk = self._call(scores, "matmul")
        if qk is None:
            return None
        k_perm = self._call(qk.args[1], "permute_dims")
        if k_perm is None or not _permutes(k_perm, _LAST_TWO):
            return None
        return _Scores(qk.args[0], k_perm.args[0], qk.args[1], scale, bias)

    def fuse(self, product: relax.Call, out_heads_last: bool,
             product_var: relax.Var) -> tuple[relax.Expr, _CacheAppend | None] | None:
        """The call for ``product`` = ``softmax(..) @ v`` (bound to ``product_var``) and the
        cache append it makes, or None where it does not fit."""
        found = self._scores(product)
        if found is None:
            return None
        q, k, scale, bias = found.q, found.k, found.scale, found.bias
        # v as this mutator has it (an earlier attention fused here renames its output);
        # q, k and the bias come through lookup_binding, rewritten already.
        v = self.visit_expr(product.args[1])
        shapes = [_dims(e) for e in (q, k, v, product)]
        dtypes = {str(e.ty.dtype) for e in (q, k, v, product)}
        if any(s is None or len(s) != 4 for s in shapes) or len(dtypes) != 1:
            return None
        batch, heads, rows, head_dim = shapes[0]
        keys = shapes[1][2]
        # A query of a few rows (decode's one) on the decode kernel, which takes fp32 too.
        decode = _static(rows) is not None and _static(rows) < DECODE_ROWS
        if dtypes.pop() not in (DECODE_DTYPES if decode else DTYPES) or \
                _static(head_dim) not in HEAD_DIMS or _static(heads) is None:
            return None
        # The kernel reads k and v at q's batch and head, as many keys in both, and one
        # head_dim throughout: a matmul broadcasting k or v (shared heads) is left alone.
        same = [(s[0], batch) for s in shapes[1:]] + [(s[1], heads) for s in shapes[1:]] + \
            [(s[3], head_dim) for s in shapes[1:]] + [(shapes[2][2], keys), (shapes[3][2], rows)]
        if not all(self.analyzer.can_prove_equal(x, y) for x, y in same):
            return None
        append = self._cache_append(k, v, found.k_transposed, product_var) \
            if decode and _static(rows) >= 1 and APPEND_TO_CACHES else None
        new_views: list[_View] = []
        if append is not None:  # k and v read from the pasts, the new rows besides
            views = [self._view(e) for e in (q, append.k_past, append.v_past)]
            new_views = [self._view(e) for e in (append.k_new, append.v_new)]
            if not all(self._aligned(view.layout) and self._visible(view.tensor)
                       for view in views + new_views):
                append, new_views = None, []  # the attention alone, reading the concats
        if append is None:
            views = [self._view(e) for e in (q, k, v)]
            if not all(self._aligned(view.layout) for view in views):
                return None
        mask = bias if isinstance(bias, _KeyMask) else None
        causal = bias is not None and mask is None and self._causal(bias, rows, keys)
        bias_layout = ViewLayout(0, 0, 0, 0)
        if bias is not None and not causal:
            if mask is None and str(bias.ty.dtype) != str(product.ty.dtype):
                return None
            shape = _dims(mask.keep if mask is not None else bias)
            bias_layout = self._bias_layout(shape, [batch, heads, rows, keys])
            if bias_layout is None:
                return None
        operands = [view.tensor for view in views]
        if bias is not None and not causal:  # the bias read, or what it is made from
            operands.append(mask.keep if mask is not None else bias)
        if not all(self._visible(x) for x in operands):
            return None
        if mask is not None:
            bias = self._mask_bias(mask, str(product.ty.dtype))
        if out_heads_last:  # written [b, r, h, d]: the transpose after it is done
            out_shape = [batch, rows, heads, head_dim]
            out_layout = ViewLayout(0, rows * heads * head_dim, head_dim, heads * head_dim)
        else:
            out_shape = [batch, heads, rows, head_dim]
            out_layout = ViewLayout(0, heads * rows * head_dim, rows * head_dim, head_dim)
        cache = {}
        if append is not None:
            present = ViewLayout(0, heads * keys * head_dim, keys * head_dim, head_dim)
            cache = {"past": _dims(append.k_past)[2], "k_new": new_views[0].layout,
                     "v_new": new_views[1].layout, "k_present": present, "v_present": present}
        layout = AttentionLayout(batch, heads, rows, keys, head_dim,
                                 *(v.layout for v in views), out_layout, bias_layout, **cache)
        function = AttentionFunction(bias=bias is not None and not causal, causal=causal,
                                     decode=decode, append=append is not None)
        args = [view.tensor for view in views + new_views] + ([bias] if function.bias else [])
        args += [relax.ShapeExpr(layout.to_shape()), tirx.FloatImm("float32", scale)]
        self.fused += 1
        out_ty = relax.TensorType(out_shape, product.ty.dtype)
        if append is not None:
            out_ty = [out_ty, append.k_present.ty, append.v_present.ty]
        return relax.op.call_dps_packed(function.name, relax.Tuple(args), out_ty), append

    def _cache_append(self, k: relax.Expr, v: relax.Expr, k_transposed: relax.Expr,
                      product_var: relax.Var) -> _CacheAppend | None:
        """k and v as a cache append the decode kernel can make (``_CacheAppend``): each a
        dataflow variable bound to ``concat([past, new], axis=2)``, with past and new of
        one shape but their rows, and read, besides by this attention (k through
        ``k_transposed``, v by the product), only after it: the call then writes them."""
        now = self.order.get(self.binding)
        if now is None or not self._once(k_transposed):  # inside an if; k^T read again
            return None
        parts = []
        for present, own_reader in ((k, k_transposed), (v, product_var)):
            concat = self._call(present, "concat")
            if not isinstance(present, relax.DataflowVar) or concat is None or \
                    not isinstance(concat.args[0], relax.Tuple) or \
                    len(concat.args[0].fields) != 2 or int(concat.attrs.axis) not in (2, -2):
                return None
            # A reader not among the function's bindings (inside an if) counts as before.
            if any(r is not None and not r.same_as(own_reader) and self.order.get(r, now) <= now
                   for r in self.readers.get(present, [])):
                return None
            past, new = concat.args[0].fields
            past_dims, new_dims, dims = _dims(past), _dims(new), _dims(present)
            if past_dims is None or new_dims is None or not all(
                    self.analyzer.can_prove_equal(past_dims[i], dims[i]) and
                    self.analyzer.can_prove_equal(new_dims[i], dims[i]) for i in (0, 1, 3)):
                return None
            parts.append((present, past, new))
        (k_present, k_past, k_new), (v_present, v_past, v_new) = parts
        if not (self.analyzer.can_prove_equal(_dims(k_past)[2], _dims(v_past)[2]) and
                self.analyzer.can_prove_equal(_dims(k_new)[2], _dims(v_new)[2])):
            return None
        return _CacheAppend(k_present, v_present, k_past, k_new, v_past, v_new)

    def _visible(self, operand: relax.Expr) -> bool:
        """Whether the call, emitted at the binding being visited, can read ``operand``: a
        dataflow variable of an earlier block is gone (a product that is a block's output
        may be transposed, or multiplied by v, in a later block)."""
        return not (isinstance(operand, relax.DataflowVar) and operand in self.gone)

    def _mask_bias(self, mask: _KeyMask, dtype: str) -> relax.Var:
        """The bias ``where(keep, 0, fill)``, emitted once a block for every attention it
        masks (a decoder's layers share one)."""
        key = (mask.keep, mask.fill, dtype)
        if key not in self.mask_biases:
            self.mask_biases[key] = self.builder_.emit(relax.op.where(
                mask.keep, relax.const(0.0, dtype), relax.const(mask.fill, dtype)), "mask_bias")
        return self.mask_biases[key]

    def _new_block(self) -> None:
        self.gone |= {v for v in self.block_vars if isinstance(v, relax.DataflowVar)}
        self.block_vars, self.mask_biases = set(), {}

    def visit_binding_block_(self, block):  # pylint: disable=arguments-renamed
        self._new_block()
        return super().visit_binding_block_(block)

    def visit_dataflow_block_(self, block):  # pylint: disable=arguments-renamed
        self._new_block()
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        self._visit_binding(binding)
        self.block_vars |= {binding.var, self.visit_expr(binding.var)}  # as bound, as renamed

    def _visit_binding(self, binding: relax.VarBinding) -> None:
        value, fused = binding.value, None
        self.binding = binding.var
        if not isinstance(value, relax.Call):
            pass
        elif _heads_back(value) and self._once(value.args[0]):
            product = self._call(value.args[0], "matmul")
            fused = self.fuse(product, True, value.args[0]) if product is not None else None
        elif value.op == _OPS["matmul"] and binding.var not in self.transposed:
            fused = self.fuse(value, False, binding.var)
        if fused is None:
            super().visit_var_binding_(binding)
            return
        call, append = fused
        if append is None:
            self.set_var_remap(binding.var, emit_as(self.builder_, binding.var, call))
            return
        # The output and the present caches out of one call. The concats and k^T, bound
        # before and unread now, go with transform_module's remove_all_unused.
        results = self.builder_.emit(call, "attention_append")
        self.set_var_remap(binding.var, emit_as(self.builder_, binding.var,
                                                relax.TupleGetItem(results, 0)))
        for index, present in ((1, append.k_present), (2, append.v_present)):
            self.set_var_remap(present, self.builder_.emit(relax.TupleGetItem(results, index),
                                                           present.name))


def _permutes(call: relax.Call, axes: list[int]) -> bool:
    """``call`` is ``permute_dims(x, axes)``."""
    return call.op == _OPS["permute_dims"] and call.attrs.axes is not None and \
        [int(a) for a in call.attrs.axes] == axes


def _heads_back(call: relax.Call) -> bool:
    """Attention's output back to [b, r, h, d]."""
    return _permutes(call, _HEADS_AND_ROWS)


def _transposed_once(func: relax.Function, reads: dict) -> set[relax.Var]:
    """Variables read once, by ``_heads_back``: their product is fused at the transpose."""
    found: set[relax.Var] = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and _heads_back(expr) and \
                isinstance(expr.args[0], relax.Var) and reads.get(expr.args[0]) == 1:
            found.add(expr.args[0])

    relax.analysis.post_order_visit(func, visit)
    return found


def _binding_order(func: relax.Function) -> tuple[dict, dict]:
    """The position of each binding of ``func``'s body (blocks in order), and for each
    variable the bound variables of the bindings that read it (None: the body's result,
    read after every binding). An ``if``'s branches are read at the binding of the if."""
    order: dict[relax.Var, int] = {}
    readers: dict[relax.Var, list] = {}

    def read_by(expr: relax.Expr, reader) -> None:
        found = set()
        relax.analysis.post_order_visit(
            expr, lambda e: isinstance(e, relax.Var) and found.add(e))
        for var in found:
            readers.setdefault(var, []).append(reader)

    body = func.body
    if isinstance(body, relax.SeqExpr):
        for block in body.blocks:
            for binding in block.bindings:
                order[binding.var] = len(order)
                read_by(binding.value, binding.var)
        body = body.body
    read_by(body, None)
    return order, readers


def _prim(expr: relax.Expr):
    """A dim or scalar argument of a Relax call (TVM 0.27 passes them as expressions of dims,
    no PrimValue), else None."""
    return expr if isinstance(getattr(expr, "ty", None), PrimType) else None


def _scalar_prim(expr: relax.Expr) -> int | None:
    value = _prim(expr)
    return int(value) if isinstance(value, tirx.IntImm) else None


@module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Run attention as one kernel: ``softmax(q @ permute_dims(k) * scale + bias) @ v`` over
    [batch, heads, rows, head_dim] tensors (head_dim 64 or 128, heads static) becomes one call
    of ``grape.attention.fused*`` (fp16 or bf16) or, for a query of fewer than
    ``DECODE_ROWS`` static rows (decode's one), of ``grape.decode_attention.fused*`` (fp32 too),
    whose kernel reads each key and value row once. q, k and v that are heads sliced and
    transposed out of one tensor (GPT-2's qkv product) are read in place, and a transpose of the
    output back to [batch, rows, heads, head_dim] is written directly. A bias of ``where(key <=
    query, 0, -65504)`` over aranges of as many keys as rows (a causal mask, as Hugging Face's
    exports compute it) is the kernel's causal mode: it skips the masked keys and reads no bias.
    Scores replaced where masked, ``where(keep, s, fill)`` with ``fill`` <= -1e30, are the
    bias ``where(keep, 0, fill)``, computed once a block before the call (fp32 rounds s + fill
    to fill; only a masked key whose score is not finite, an inf or NaN in its row of k,
    differs: NaN, where the ``where`` dropped it).
    The scores, their scale, the mask and the probabilities are never written to memory.
    Where a decode step's k and v are ``concat([past, new], axis=2)`` (Hugging Face's present
    caches) and nothing else reads them before the attention, the call is of the
    ``_append`` function: it reads the past and the new rows where they are and writes the
    presents itself, so the concats, left unread, go.

    Before (``s`` symbolic)::

        qkv_heads = R.reshape(qkv, (b, s, 36, 64))
        q = R.permute_dims(R.strided_slice(qkv_heads, [2], [0], [12]), [0, 2, 1, 3])
        k = R.permute_dims(R.strided_slice(qkv_heads, [2], [12], [24]), [0, 2, 1, 3])
        v = ...                                                    # heads 24..36
        scores = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2])) * R.const(0.125, "float16")
        probs = R.nn.softmax(scores + mask, axis=-1)               # mask: causal, as above
        out = R.permute_dims(R.matmul(probs, v), [0, 2, 1, 3])     # (b, s, 12, 64)

    After::

        out = R.call_dps_packed("grape.attention.fused_causal",
                                (qkv, qkv, qkv, R.shape([b, 12, s, s, 64,
                                 0, s * 2304, 64, 2304,        # q: offset, batch, head, row
                                 768, s * 2304, 64, 2304,      # k
                                 1536, s * 2304, 64, 2304,     # v
                                 0, s * 768, 64, 768,          # out
                                 0, 0, 0, 0]),                 # no bias
                                 T.float32(0.125)),
                                out_ty=R.Tensor((b, s, 12, 64), "float16"))

    A decode step (``p`` symbolic, fp32), before::

        scores = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2])) * R.const(0.125)  # q: (b, 12, 1, 64)
        out = R.matmul(R.nn.softmax(scores + mask, axis=-1), v)        # k, v: (b, 12, p, 64)

    After::

        out = R.call_dps_packed("grape.decode_attention.fused_bias",
                                (q, k, v, mask, R.shape([b, 12, 1, p, 64,
                                 0, 768, 64, 64,  0, 768 * p, 64 * p, 64,  0, 768 * p, 64 * p, 64,
                                 0, 768, 64, 64,  0, p, 0, p]), T.float32(0.125)),
                                out_ty=R.Tensor((b, 12, 1, 64), "float32"))

    The same step appending to its cache (k_new, v_new: heads of the step's qkv, as q),
    before::

        present_k = R.concat((past_k, k_new), axis=-2)                # (b, 12, p + 1, 64)
        scores = R.matmul(q, R.permute_dims(present_k, [0, 1, 3, 2])) * R.const(0.125)
        present_v = R.concat((past_v, v_new), axis=-2)
        out = R.matmul(R.nn.softmax(scores + mask, axis=-1), present_v)
        gv = (out, present_k, present_v)

    After::

        results = R.call_dps_packed("grape.decode_attention.fused_bias_append",
                                    (qkv, past_k, past_v, qkv, qkv, mask, R.shape([b, 12,
                                     1, p + 1, 64, p,         # sizes, the past's rows
                                     ...,                     # q, k, v (the pasts), out, bias
                                     768, 2304, 64, 2304,     # k_new
                                     1536, 2304, 64, 2304,    # v_new
                                     0, 768 * (p + 1), 64 * (p + 1), 64,  # k_present
                                     0, 768 * (p + 1), 64 * (p + 1), 64]),  # v_present
                                     T.float32(0.125)),
                                    out_ty=R.Tuple(R.Tensor((b, 12, 1, 64)),
                                                   R.Tensor((b, 12, p + 1, 64)),
                                                   R.Tensor((b, 12, p + 1, 64))))
        gv = (results[0], results[1], results[2])
    """

    def transform_module(self, mod: IRModule, ctx: PassContext) -> IRModule:
        fuser = _Fuser(mod)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                fuser.reads = read_counts(func)
                fuser.transposed = _transposed_once(func, fuser.reads)
                fuser.order, fuser.readers = _binding_order(func)
                before = fuser.fused
                new = fuser.visit_expr(func)
                if fuser.fused > before:
                    fuser.builder_.update_func(gvar, relax.analysis.remove_all_unused(new))
        return fuser.builder_.get() if fuser.fused else mod
