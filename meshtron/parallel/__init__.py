"""Parallel runtime: device mesh from a plan, and parallelism applied from outside the model.

- `build_mesh(plan)` -> DeviceMesh with axes ("dp_replicate", "dp_shard", "pp", "tp") (+ "dp").
- `parallelize(model, plan, mesh)` -> ParallelModel (pipeline, tensor/sequence parallel,
  activation checkpointing, FSDP2 per ZeRO stage, in that order).
- `build_optimizer(pm, lr)` -> AdamW over the rank's model parts (ZeRO-1 sharded when asked).
- `release_mesh(mesh)` -> destroys the mesh's process groups (before building another).
"""

from meshtron.parallel.api import (
    ParallelModel,
    ParallelOptimizer,
    build_optimizer,
    grad_norm,
    parallelize,
)
from meshtron.parallel.mesh import MESH_DIMS, Layout, build_mesh, release_mesh, resolve_plan

__all__ = [
    "MESH_DIMS", "Layout", "ParallelModel", "ParallelOptimizer", "build_mesh", "build_optimizer",
    "grad_norm", "parallelize", "release_mesh", "resolve_plan",
]
