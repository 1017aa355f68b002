"""ONNX's backend node suite: every case runs unless ``node_suite`` excludes it with a reason.

Cases are built in memory by ``load_model_tests(kind="node")``; exclusions are listed with their
reasons in ``node_suite.EXCLUDED`` (and counted in the README).
"""

import re
import warnings

import onnx.backend.test
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


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    _backend_test = onnx.backend.test.BackendTest(TrOnnxBackend, __name__)
_included, _ = classify()
_wanted = re.compile("^(" + "|".join(re.escape(n) for n in _included) + ")_cpu$")
# BackendTest would generate (and skip) every case of every kind; keep only the node cases we
# include, so the report shows no skips that are not real.
OnnxBackendNodeModelTest = _backend_test.test_cases["OnnxBackendNodeModelTest"]
for _name in [n for n in vars(OnnxBackendNodeModelTest)
              if n.startswith("test_") and not _wanted.match(n)]:
    delattr(OnnxBackendNodeModelTest, _name)
