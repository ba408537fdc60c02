"""autopar: automatic data x pipeline x tensor parallelism for GPT-style PyTorch models.

    pm = autopar.parallelize(model, mesh=(dp, pp, tp), example_inputs=(idx, targets))
    loss = pm.train_step(idx, targets)
    print(pm.plan.summary())

Submodules load on first use, so ``autopar.launch.guard()`` or ``autopar.checkpoint.save_checkpoint``
work after a plain ``import autopar``.
"""
import importlib
import importlib.util

from autopar.api import cost_expr, parallelize, plan
from autopar.determinism import set_deterministic
from autopar.flops import FlopsReport, flops_report, report_table
from autopar.runtime.master_weights import MasterAdamW
from autopar.mesh import Mesh
from autopar.runtime.parallel_model import ParallelModel
from autopar.placement import Partial, Replicate, Shard
from autopar.plans import Plan, PlanFormatError
from autopar.rehearsing import rehearse
from autopar.errors import PlanError

__all__ = ["parallelize", "plan", "cost_expr", "rehearse", "Mesh", "Plan", "ParallelModel", "PlanError", "PlanFormatError",
           "Shard", "Replicate", "Partial", "set_deterministic", "MasterAdamW",
           "flops_report", "FlopsReport", "report_table"]


def __getattr__(name: str):
    """A submodule (``autopar.launch``, ``autopar.checkpoint``, ...), imported on first use."""
    if not name.startswith("_") and importlib.util.find_spec(f"autopar.{name}") is not None:
        return importlib.import_module(f"autopar.{name}")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
