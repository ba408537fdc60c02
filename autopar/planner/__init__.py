"""The planner: policy. It decides, the cost model prices, and the result is a Plan.

In the order ``decide`` takes the decisions:

- ``request``: the knobs, checked once (``Request``), and the planning ``Job``;
- ``choices``: the choice loops: the meshes (``mesh_search``: mesh="auto", every mesh planned
  and ranked), the microbatch count, offload and ZeRO on one mesh;
- ``price``: one candidate priced: ``sharding``, the strategies each node may take and the
  tensor-parallel ILP over them (``ilp``; ``megatron``: the hand-written Megatron-LM plan derived
  from the graph's structure), ``stage_cut`` and ``stage_dp`` (pipeline stage cuts, a DP over the
  layer units), ``recompute`` (where to recompute), ``reshard`` (ZeRO-3's units kept gathered);
  the memory and the step's terms are the cost model's;
- ``candidate``: a candidate's choices and figures, and the one Plan built from the kept one;
- ``decide``: the order of decisions, and ``rebuild`` on the other ranks.

Search code is pure over plain data, with its maths in its module's docstring. Nothing here
imports the runtime.
"""
from autopar.errors import PlanError

__all__ = ["PlanError"]
