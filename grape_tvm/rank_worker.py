"""One disco worker process of a ``TensorParallelSession`` (its ``ProcessSession``'s
entrypoint, ``python -m grape_tvm.rank_worker``): TVM's worker loop, with grape's
``grape.rank.*`` functions registered first. TVM's own entrypoint registers only what it
imports, and its ``import_python_module`` is itself a Python function a worker does not have.
"""

from __future__ import annotations

from grape_tvm import tensor_parallel_session


def main() -> None:
    tensor_parallel_session.load_disco()
    from tvm.exec import disco_worker  # pylint: disable=import-outside-toplevel

    disco_worker.main()


if __name__ == "__main__":
    try:
        main()
    except (OSError, KeyboardInterrupt):  # the controller went away: as TVM's worker does
        pass
