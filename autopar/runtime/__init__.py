"""The runtime: what runs the programs the passes built.

``parallel_model``: ParallelModel, one rank's shards and its training step; ``pipeline``: the
stages on torch.distributed.pipelining; ``zero``: ZeRO's sharded optimizer state;
``master_weights`` and ``precision``: 16-bit working copies, fp32 master weights, loss scaling.
Nothing here imports the planner.
"""
