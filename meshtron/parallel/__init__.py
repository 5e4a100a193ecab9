"""Parallel runtime: device mesh from a plan, and parallelism applied from outside the model.

- `build_mesh(plan)` -> DeviceMesh with axes ("pp", "dp_replicate", "dp_shard", "tp") (+ "dp").
- `plan`: a meshtron Plan, a saved plan file, or a dict of Plan fields (else UserError).
- `parallelize(model, plan, mesh)` -> ParallelModel (pipeline, tensor/sequence parallel,
  activation checkpointing, FSDP2 per ZeRO stage, in that order).
- `build_optimizer(pm, lr)` -> AdamW over the rank's model parts (ZeRO-1 sharded when asked).
- `release_mesh(mesh)` -> destroys the mesh's process groups (before building another).
"""

from meshtron.parallel.api import parallelize
from meshtron.parallel.mesh import MESH_DIMS, build_mesh, release_mesh, resolve_plan
from meshtron.parallel.optimizer import ParallelOptimizer, build_optimizer
from meshtron.parallel.parallel_model import ParallelModel, grad_norm
from meshtron.planner.plan import Plan

__all__ = [
    "MESH_DIMS", "ParallelModel", "Plan", "ParallelOptimizer", "build_mesh", "build_optimizer",
    "grad_norm", "parallelize", "release_mesh", "resolve_plan",
]
