"""The ONNX conformance runner on a small slice of onnx's node test cases (CPU, ~1 minute)."""

from __future__ import annotations

import json
import re

import pytest

from grape_tvm import conformance

# Elementwise, matmul, softmax (and its function expansion), shape ops, gather, If, and
# cases TVM's importer is known to fail (AffineGrid, SequenceMap).
SLICE = ["test_add", "test_matmul_2d", "test_relu", "test_softmax_axis_0",
         "test_reshape_reduced_dims", "test_concat_2d_axis_0", "test_gather_0",
         "test_if", "test_affine_grid_2d", "test_sequence_map_add_2_sequences"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("conformance") / "conformance.json"
    assert conformance.main(["--filter", ",".join(SLICE), "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())


def test_report_has_the_keys_and_consistent_counts(report):
    for key in ("cases", "tvm_pass", "grape_pass", "grape_fail_where_tvm_passes", "failures",
                "tvm_failures", "categories", "command"):
        assert key in report, key
    assert report["cases"] >= len(SLICE)
    assert report["grape_pass"] + len(report["failures"]) == report["cases"]
    assert report["tvm_pass"] + len(report["tvm_failures"]) == report["cases"]
    assert sum(report["categories"].values()) == len(report["failures"])
    assert set(report["grape_fail_where_tvm_passes"]) == \
        set(report["failures"]) - set(report["tvm_failures"])
    assert "grape_tvm.conformance" in report["command"]
    # The slice has cases that pass and cases TVM is known to fail.
    assert report["tvm_pass"] > 0 and report["grape_pass"] > 0
    assert "test_affine_grid_2d" in report["tvm_failures"]
    assert "test_sequence_map_add_2_sequences" in report["tvm_failures"]


def test_grape_passes_every_case_tvm_passes(report):
    assert report["grape_fail_where_tvm_passes"] == [], \
        {c: report["failures"][c] for c in report["grape_fail_where_tvm_passes"]}


def test_every_failure_reason_names_the_operator_and_the_cause(report):
    cause = re.compile(r"\b\w*(Error|Exception|NotImplemented)\b|wrong result|crashed: |timeout: ")
    for failures in (report["failures"], report["tvm_failures"]):
        for case, reason in failures.items():
            assert reason and "\n" not in reason, (case, reason)
            op, _, rest = reason.partition(": ")
            assert re.fullmatch(r"[A-Z]\w*", op), (case, reason)  # an ONNX operator type
            assert cause.search(rest), (case, reason)


def test_compare_follows_onnx_runner():
    import numpy as np  # pylint: disable=import-outside-toplevel

    x = np.array([1.0, 2.0, np.nan], np.float32)
    assert conformance.compare([x + 1e-4], [x], 1e-3, 1e-7) is None
    assert "max abs err" in conformance.compare([x + 1], [x], 1e-3, 1e-7)
    assert "dtype" in conformance.compare([x.astype(np.float64)], [x], 1e-3, 1e-7)
    assert "shape" in conformance.compare([x[:2]], [x], 1e-3, 1e-7)
    i = np.array([1, 2, 3], np.int64)
    assert "1 of 3 elements differ" in conformance.compare([i + [0, 0, 1]], [i], 1, 1)
    assert conformance.category("Add: crashed: signal 11 (SIGSEGV) in run: x") == \
        "crashed: signal 11 (SIGSEGV) in run"
