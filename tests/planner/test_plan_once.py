"""parallelize plans once: rank 0 captures, prices and solves; the other ranks rebuild their
strategies from the broadcast plan without pricing (tests/graph/test_capture_constants.py checks that they
print none of the capture's warnings)."""
from __future__ import annotations

import autopar
from autopar import api
from autopar.planner import candidate, price as planning
from autopar.examples.gpt import example_inputs
import pool
from parity import BATCH, SEQ, TINY, make_model


def _counted(rank, world):
    calls = {"decide": 0, "solve": 0, "sharding_record": 0, "plan": 0}
    originals = []

    def count(owner, name):
        original = getattr(owner, name)
        originals.append((owner, name, original))

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)
        setattr(owner, name, wrapper)

    count(api, "decide")
    for name in ("solve", "sharding_record"):   # imported by name: count them where the planner calls them
        count(planning, name)
    count(candidate.Candidate, "plan")   # the one place a Plan is made from a candidate
    try:
        idx, tgt = example_inputs(TINY, BATCH, SEQ)
        pm = autopar.parallelize(make_model(), (1, 1, 2), (idx, tgt), plan="megatron", compile=False)
        return calls, pm.plan.to_json(), pm.train_step(idx, tgt).item()
    finally:   # the pooled rank runs other tests' jobs next
        for owner, name, original in originals:
            setattr(owner, name, original)


COUNTED = pool.job(2, _counted, timeout=300)


def test_only_rank_0_prices_the_plan():
    (calls0, plan0, loss0), (calls1, plan1, loss1) = COUNTED.result()
    assert calls0 == {"decide": 1, "solve": 1, "sharding_record": 1, "plan": 1}
    assert calls1 == {"decide": 0, "solve": 0, "sharding_record": 0, "plan": 0}
    assert plan0 == plan1 and loss0 == loss1
