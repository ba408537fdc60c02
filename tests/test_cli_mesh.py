"""`python -m autopar plan --mesh` in axis=size form (HSDP), run in process through
``autopar.__main__.main`` (no subprocess: the parsing is what is tested)."""
from __future__ import annotations

import pytest

from autopar.__main__ import _mesh, main


def test_axis_sizes_parse_to_the_dict_autopar_plan_takes():
    assert _mesh("dp_replicate=2,dp_shard=4,tp=1") == {"dp_replicate": 2, "dp_shard": 4, "tp": 1}
    assert _mesh(" auto ") == "auto" and _mesh("8,1,1") == "8,1,1"


@pytest.mark.parametrize("text, words", [
    ("dp_replicate=2,dp_shards=4", ["unknown mesh axis 'dp_shards'", "dp_shard"]),
    ("dp=8,dp_shard=4", ["give dp whole, or split as dp_replicate x dp_shard"]),
    ("dp_replicate=two", ["'dp_replicate=two' is not axis=size", "dp_replicate=2,dp_shard=4,tp=1"]),
    ("tp=2,tp=4", ["axis tp is given twice"]),
])
def test_a_bad_axis_list_is_one_line_and_exit_2(capsys, text, words):
    assert main(["plan", "gpt2", "--mesh", text, "--batch", "8", "--seq", "128"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    for w in words:
        assert w in err, err


def test_plan_on_an_hsdp_mesh(capsys, tmp_path):
    out = tmp_path / "hsdp.json"
    assert main(["plan", "gpt2", "--mesh", "dp_replicate=2,dp_shard=4,tp=1", "--batch", "8", "--seq", "128",
                 "--zero", "2", "--out", str(out)]) == 0
    from autopar.plans import Plan
    plan = Plan.from_json(str(out))
    assert tuple(plan.mesh) == (8, 1, 1) and plan.dp_replicate == 2 and plan.zero == 2
    assert any(c.axis == "dp_replicate" for c in plan.collectives)   # the replicas' all-reduce is priced
