"""The runtime: what runs the programs the passes built.

``program``: one rank's program as data (``program_for``), built without process groups;
``groups``: the process groups per mesh axis; ``lowering`` and ``compiler``: a program's passes
run and its graphs compiled; ``parallel_model``: ParallelModel, one rank's shards and its training
step, with ``parameters`` (the shards), ``step`` (a step's batch and gradient sync),
``gradients`` (norms, gathered tensors) and ``optimizers``; ``pipeline``: the stages on
torch.distributed.pipelining; ``zero``: ZeRO's sharded optimizer state; ``offload`` and
``offload_optimizer``: the optimizer on the host, whole or in part; ``master_weights`` and ``precision``: 16-bit working copies, fp32 master
weights, loss scaling. Nothing here imports the planner or the cost model.
"""
