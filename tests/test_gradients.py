"""Every gradient rule against float64 finite differences (tables in grad_cases_*.py), with
channel_align 1 and 8, and every differentiable op covered by a case."""

import importlib
import pkgutil
from pathlib import Path

import pytest
from gradcheck import check_case

from tr_onnx.registry import default_registry

_TABLES = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                 if m.name.startswith("grad_cases_"))
CASES = [case for name in _TABLES for case in importlib.import_module(name).CASES]


@pytest.mark.parametrize("align", [1, 8], ids=["align1", "align8"])
@pytest.mark.parametrize("case", [  # a case of an internal op builds a model holding it
    pytest.param(c, marks=pytest.mark.internal_ops) if c.domain == "ai.tr_onnx" else c
    for c in CASES], ids=[c.id for c in CASES])
def test_gradient_matches_finite_differences(case, align):
    check_case(case, channel_align=align)


def test_every_differentiable_op_has_a_rule_and_a_case():
    registry = default_registry()
    covered = {(c.domain, c.op) for c in CASES}
    missing_rule, missing_case = [], []
    for key in registry.keys():
        opdef = registry.lookup(key.domain, key.op_type, key.since_version, key.backend)
        if opdef.differentiable and opdef.gradient is None:
            missing_rule.append(key.op_type)
        if opdef.gradient is not None and key.domain in ("", "ai.onnx") \
                and (key.domain, key.op_type) not in covered:
            missing_case.append(key.op_type)
    assert not sorted(set(missing_rule)), "declared differentiable without a rule"
    assert not sorted(set(missing_case)), "gradient rules without a finite-difference case"
