"""ONNX's backend node suite: every case runs unless ``node_suite`` excludes it with a reason.

Cases are built in memory by ``load_model_tests(kind="node")``; exclusions are listed with their
reasons in ``node_suite.EXCLUDED`` (and counted in docs/verification.md).
"""

import re
import warnings

import numpy as np
import onnx.backend.test
import pytest
from node_suite import LOADED_FLOOR, all_cases, classify

from tr_onnx.onnx_backend import TrOnnxBackend


def test_node_suite_loaded_enough_cases():
    assert len(all_cases()) > LOADED_FLOOR
    included, _ = classify()
    assert len(included) > 100


def test_node_suite_every_case_is_run_or_excluded_with_a_reason():
    included, excluded = classify()
    names = [case.name for case in all_cases()]
    assert sorted(included + list(excluded)) == sorted(names)
    assert all(reason for reason in excluded.values())


class ItemwiseBackendTest(onnx.backend.test.BackendTest):
    """onnx's runner, with a sequence output's items compared as outputs of their own (same
    rtol/atol). onnx's comparison passes each item where it expects a list of outputs: it
    calls len() on it (a TypeError for a 0-d tensor, test_loop16_seq_none) and compares an
    n-d item row by row, and it never checks that the two lists have the same length."""

    @classmethod
    def assert_similar_outputs(cls, ref_outputs, outputs, rtol, atol, model_dir=None):
        np.testing.assert_equal(len(outputs), len(ref_outputs),
                                err_msg=f"number of outputs or items ({model_dir or '?'})")
        for i, (ref, out) in enumerate(zip(ref_outputs, outputs)):
            listed = isinstance(ref, (list, tuple)), isinstance(out, (list, tuple))
            if any(listed):
                assert all(listed), f"output {i}: expected {type(ref)}, got {type(out)}"
                cls.assert_similar_outputs(ref, out, rtol, atol, model_dir)
            else:
                super().assert_similar_outputs([ref], [out], rtol, atol, model_dir)


def test_sequence_outputs_are_compared_item_by_item():
    """The comparison the cases below run under: equal lists pass (a 0-d item too); a list
    one item short, or an item off by more than rtol/atol, fails."""
    same = [np.array(1.0, np.float32), np.ones((2, 3), np.float32)]
    ItemwiseBackendTest.assert_similar_outputs([same], [list(same)], 1e-3, 1e-7)
    with pytest.raises(AssertionError):
        ItemwiseBackendTest.assert_similar_outputs([same], [same[:1]], 1e-3, 1e-7)
    with pytest.raises(AssertionError):
        ItemwiseBackendTest.assert_similar_outputs(
            [same], [[np.array(1.01, np.float32), same[1]]], 1e-3, 1e-7)


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _backend_test = ItemwiseBackendTest(TrOnnxBackend, __name__)
_included, _ = classify()
_wanted = re.compile("^(" + "|".join(re.escape(n) for n in _included) + ")_cpu$")
# BackendTest would generate (and skip) every case of every kind; keep only the node cases we
# include, so the report shows no skips that are not real.
OnnxBackendNodeModelTest = _backend_test.test_cases["OnnxBackendNodeModelTest"]
for _name in [n for n in vars(OnnxBackendNodeModelTest)
              if n.startswith("test_") and not _wanted.match(n)]:
    delattr(OnnxBackendNodeModelTest, _name)
