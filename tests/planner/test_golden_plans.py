"""Plans kept as golden files (tests/golden/): a change to the planner that changes a decision or a
figure shows here, case by case, and its golden file is rewritten on purpose
(``python tests/golden/cases.py NAME``) in the commit that explains why."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "golden"))
from cases import CASES, HERE, plan_case  # noqa: E402

from autopar import Plan  # noqa: E402


@pytest.mark.parametrize("name", list(CASES))
def test_plan_equals_its_golden_file(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    golden = Plan.from_json(HERE / f"{name}.json")
    assert plan_case(name).diff(golden) == "no differences"
