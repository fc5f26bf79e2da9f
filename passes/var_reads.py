"""How often each variable of a Relax expression is read, and rebinding a variable a
mutator rewrites."""

from __future__ import annotations

from tvm import relax


def read_counts(expr: relax.Expr) -> dict[relax.Var, int]:
    """The number of reads of each variable in ``expr`` (a function's body, or the function
    with its parameters' reads), the bindings inside an ``if``'s branches included; a
    variable's definition is not a read."""
    count: dict[relax.Var, int] = {}

    def read(node):
        if isinstance(node, relax.Var):
            count[node] = count.get(node, 0) + 1

    relax.analysis.post_order_visit(expr, read)
    return count


def emit_as(builder: relax.BlockBuilder, var: relax.Var, value: relax.Expr) -> relax.Var:
    """``value`` emitted in place of ``var``'s binding: an output of a dataflow block (a
    variable that is not a dataflow variable) stays one."""
    output = not isinstance(var, relax.DataflowVar) and builder.current_block_is_dataflow()
    return (builder.emit_output if output else builder.emit)(value, var.name)
