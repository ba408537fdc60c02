"""Graph analysis: what the planner, the cost model and the passes read off a captured graph.

- ``capture``: torch.export's training IR of a model (``Captured``), the nodes that depend on no
  input (``input_free``), graph copies for passes (``copy_graph``); ``capture_cache`` keeps traces
  per model structure, ``block_capture`` traces a run of identical layers twice and repeats them;
- ``rules``: the sharding strategies of each op (``strategies_for``), the tensor-dim labels
  (``dim_labels``);
- ``units``: layer units (a block, the embedding, the head) and the stages they fall in;
- ``reshard``: the collectives that move a value from one placement to another;
- ``precision``: the dtypes a graph computes at under 16-bit compute (``retype_pass``).

It imports nothing of autopar but the placements, the errors and the graphs' custom ops; the
rewrites in ``autopar.passes`` and the prices in ``autopar.cost_model`` read it.
"""
