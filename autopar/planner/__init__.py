"""The planner: policy. It decides, the cost model prices, and the result is a Plan.

In the order ``decide`` takes the decisions:

- ``sharding``: the strategies each node may take, and the tensor-parallel ILP over them
  (``ilp``); ``megatron``: the hand-written Megatron-LM plan derived from the graph's structure;
- ``stage_cut`` and ``stage_dp``: pipeline stage cuts, a DP over the layer units;
- ``recompute``: memory per stage and where to recompute;
- ``mesh_search``: ``mesh="auto"``, every (dp, pp, tp) planned and ranked;
- ``decide``: the knobs, the order of decisions, the one Plan.

Search code is pure over plain data, with its maths in its module's docstring. Nothing here
imports the runtime.
"""
from autopar.errors import PlanError

__all__ = ["PlanError"]
