"""The fuzzer in CI (issue 35): a bounded campaign of ``tests/fuzz`` (a fixed seed, every case
in a process of its own under a memory limit and a timeout) must find no bug outside
``fuzz/known_bugs.py``; and the harness's own tests: each way a case can fail is reported.

    TR_ONNX_FUZZ35_CASES=400 TR_ONNX_FUZZ35_SEED=7 python -m pytest tests/test_fuzz.py
    python scripts/fuzz.py --minutes 20 --seed 35 --out fuzz-out     # before a release
"""

from __future__ import annotations

import os

import pytest
from fuzz import known_bugs, runner
from fuzz.generators import GENERATORS, MODEL, Case, make_case

SEED = int(os.environ.get("TR_ONNX_FUZZ35_SEED", "35"))
CASES = int(os.environ.get("TR_ONNX_FUZZ35_CASES", "48"))


def test_a_bounded_campaign_finds_no_bug_outside_the_known_list(tmp_path):
    records = runner.campaign(SEED, tmp_path, workers=2, cases=CASES)
    text = runner.report(records, SEED)
    print(text)
    assert len(records) == CASES, text
    assert {r["generator"] for r in records} == set(GENERATORS), text
    new = [r for r in records if r["outcome"] in runner.BUGS and not r.get("known")]
    assert not new, text + "\n\n" + "\n\n".join(
        f"case {r['index']}: {r['signature']}\n{r['description']}\n{r.get('detail', '')}\n"
        f"rerun: python tests/fuzz/runner.py --seed {SEED} --case {r['index']}" for r in new)


def test_a_case_is_a_pure_function_of_seed_and_index():
    for index in range(8):
        a, b = make_case(SEED, index), make_case(SEED, index)
        assert (a.generator, a.description, a.files) == (b.generator, b.description, b.files)
    assert make_case(SEED, 2).files != make_case(SEED + 1, 2).files


@pytest.mark.parametrize("how, outcome", [("signal", "signal"), ("hang", "timeout"),
                                          ("escape", "file_escape"), ("memory", "memory")])
def test_each_way_a_case_can_fail_is_reported(tmp_path, monkeypatch, how, outcome):
    monkeypatch.setenv(runner.SABOTAGE, how)
    case = make_case(SEED, 2)  # a random graph: references, then the case
    record = runner.run_one(case, tmp_path / "case", timeout=3.0)
    assert record["outcome"] == outcome, record
    assert record["known"] is None and record["signature"].startswith(outcome)


def test_a_known_signature_is_matched_by_its_pattern_and_names_its_item(monkeypatch):
    # the list may be empty (every bug fixed): the matching is checked on a pattern of its own
    monkeypatch.setitem(known_bugs.KNOWN, "traceback|IndexError@*|random_graph|AveragePool",
                        "issue 35 item 11: a zero-size AveragePool output was an IndexError")
    assert known_bugs.item_of("nothing|like|this|at all") is None
    assert known_bugs.item_of("traceback|IndexError@pool.py:f|random_graph|AveragePool")
    for key, item in known_bugs.KNOWN.items():
        assert item.startswith("issue 35 item"), (key, item)
        assert known_bugs.item_of(key) == item


def test_a_clean_run_of_a_valid_model_is_ok_and_equal_to_the_references(tmp_path):
    case = Case("random_graph", 0, "Relu", "Relu", {}, oracle=True)
    base = make_case(SEED, 2)
    case.files = {**base.files}
    record = runner.run_one(case, tmp_path / "case")
    assert record["outcome"] == "ok", record
    assert record["oracle"] and record["detail"] == \
        "equal to both references (also channel_align=4)"
    assert MODEL in case.files


@pytest.mark.parametrize("index", [82, 111], ids=["while_loop", "counted_loop"])
def test_the_loops_of_the_random_graphs_run_and_equal_the_references(tmp_path, index):
    case = make_case(SEED, index)
    assert case.subject == "Loop", case.description
    record = runner.run_one(case, tmp_path / "case")
    assert record["outcome"] == "ok" and record["oracle"], record


def test_every_op_of_the_random_graphs_has_a_schema_and_a_numpy_kernel():
    from fuzz.generators import _OPS, OPSET

    from tr_onnx.registry import default_registry, schema_for

    registry = default_registry()
    for op in _OPS:
        schema = schema_for("", op, OPSET)
        assert schema is not None, op
        assert registry.lookup("", op, schema.since_version, "numpy") is not None, op
