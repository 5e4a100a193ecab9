"""Every private or version-specific torch symbol meshtron uses, in one registry.

meshtron runs on the torch a GPU image carries (2.11 on the first H200 lent to the project)
and on the CPU pin (2.13.0). Private names (a leading underscore anywhere in the path) may
move or vanish between releases, so each one is listed here with what needs it;
tests/test_torch_compat.py scans the package for private torch symbols and fails on one that
is not registered, and checks that every registered one exists on the installed torch.
Callers that cannot work without a symbol ask `require`, which raises one line naming the
torch version and the feature; callers with a fallback ask `available`.

No torch import at module level (the planner's commands must not import torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from meshtron.errors import UserError

SUPPORTED_TORCH = "2.11 to 2.13"
"""The torch releases meshtron runs on (CPU CI pins 2.13.0; GPU images carried 2.11)."""

PRIVATE_APIS: dict[str, str] = {
    # model and parallelism
    "torch._grouped_mm": "MoE experts on CUDA in bf16, one grouped GEMM per matrix "
                         "(model/moe.py; per-expert matmuls without it)",
    "torch.utils._python_dispatch._disable_current_modes":
        "the fused loss's probe of addmm's fp32 output on real tensors, outside fake-tensor "
        "modes (model/loss.py; without it the 16-bit chunks are upcast, the same fp32 sum)",
    "torch._foreach_mul_": "gradient scaling of every gradient in one kernel "
                           "(parallel/parallel_model.py)",
    "torch._foreach_copy_": "the bf16 compute copy's refresh (train/precision.py)",
    "torch._utils._flatten_dense_tensors": "bucketed gradient collectives (data_parallel.py)",
    "torch._utils._unflatten_dense_tensors": "bucketed gradient collectives (data_parallel.py)",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset":
        "each rank's box of a sharded parameter, for initialization and loading (model/init.py)",
    "torch.distributed._functional_collectives.all_gather_single":
        "context parallelism's K/V all-gather (parallel/context.py; torch 2.13 name)",
    "torch.distributed._functional_collectives.all_gather_tensor":
        "context parallelism's K/V all-gather on torch before all_gather_single (2.11)",
    "torch.distributed.pipelining.stage.PipelineStage._forward_metadata_inference":
        "the first step's metadata-inference forward counts no router load "
        "(parallel/pipeline.py; torch 2.13 name)",
    "torch.distributed.pipelining.stage.PipelineStage._shape_inference":
        "the same on torch before _forward_metadata_inference (2.11)",
    "torch.distributed.pipelining.stage.PipelineStage._get_init_p2p_neighbors_ops":
        "a V schedule's neighbour warm-up without the send to its own rank, which gloo cannot "
        "pair (parallel/pipeline.py; torch 2.11 calls it for every stage, 2.13 only for other "
        "stage types)",
    "torch._C._distributed_c10d.ProcessGroup._allgather_base":
        "the recording group's all-gather under torch 2.11's name (doctor/backend.py `_OLDER`; "
        "2.13 calls all_gather_single)",
    "torch._C._distributed_c10d.ProcessGroup._reduce_scatter_base":
        "the recording group's reduce-scatter under torch 2.11's name (doctor/backend.py)",
    "torch.ops.aten._scaled_dot_product_flash_attention":
        "context parallelism without documents: SDPA's CUDA flash kernel with its "
        "log-sum-exp (parallel/cp_sdpa.py; the masked path without it)",
    "torch.ops.aten._scaled_dot_product_flash_attention_backward":
        "context parallelism without documents, CUDA backward (parallel/cp_sdpa.py)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu":
        "context parallelism without documents: SDPA's CPU flash kernel (parallel/cp_sdpa.py)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward":
        "context parallelism without documents, CPU backward (parallel/cp_sdpa.py)",
    "torch.distributed._functional_collectives.all_to_all_single_autograd":
        "expert parallelism's token exchange (parallel/expert.py); context parallelism's "
        "sliding-window halo exchange (parallel/cp_halo.py)",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor":
        "waiting for compiled blocks' collectives (parallel/compile.py)",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper":
        "activation recomputation per block (parallel/recompute.py)",
    "torch.distributed.tensor._redistribute": "releasing a mesh (parallel/mesh.py)",
    "torch.distributed.tensor._redistribute.clear_redistribute_planner_cache":
        "releasing a mesh (parallel/mesh.py)",
    "torch.distributed.tensor.debug._clear_sharding_prop_cache":
        "releasing a mesh (parallel/mesh.py)",
    "torch.distributed.device_mesh.DeviceMesh._flatten":
        "the flattened data axes dp, dp_shard_cp and dp_cp (parallel/mesh.py, data_parallel.py, "
        "parallel_model.py)",
    "torch.distributed.device_mesh.DeviceMesh._unflatten":
        "expert parallelism's ep axis split out of the data axes (parallel/mesh.py)",
    "torch.distributed.device_mesh.DeviceMesh._get_root_mesh":
        "releasing a mesh's process-group registry (parallel/mesh.py)",
    "torch.distributed.fsdp.FSDPModule._get_fsdp_state":
        "compressed gradients' FSDP2 parameter groups (compress/runtime.py); the rehearsal's "
        "lazy init (rehearse/memory.py)",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper":
        "the recomputed block whose inner module is compiled (parallel/compile.py; its "
        "_checkpoint_wrapped_module in PRIVATE_ATTRIBUTES)",
    # compile
    "torch._inductor.config": "asynchronous tensor parallelism (parallel/compile.py)",
    "torch._inductor.config._micro_pipeline_tp":
        "asynchronous tensor parallelism's inductor pass (parallel/compile.py)",
    "torch.distributed._symmetric_memory.enable_symm_mem_for_group":
        "asynchronous tensor parallelism's symmetric memory (parallel/compile.py)",
    "torch._dynamo.utils.compilation_time_metrics": "compile_time_s in metrics (compile.py)",
    # process groups and the doctor
    "torch.distributed.distributed_c10d._abort_process_group":
        "leaving after a failure without waiting for NCCL peers (runtime.py)",
    "torch.distributed.distributed_c10d._get_default_store": "the doctor's abort flag "
                                                             "(doctor/session.py)",
    "torch.distributed.distributed_c10d._resolve_process_group":
        "naming a collective's group in the doctor's records (doctor/flight.py, recorder.py)",
    "torch._C._distributed_c10d._dump_fr_trace_json":
        "the NCCL Flight Recorder's trace (doctor/flight.py, doctor/dump.py)",
    "torch._C._distributed_c10d.Work": "timing collective waits (doctor/timeline.py)",
    "torch._C._distributed_c10d.ProcessGroup": "recording collectives (doctor/recorder.py)",
    "torch._C._after_autograd_keyset": "recording collectives (doctor/recorder.py)",
    "torch._C._dispatch_get_all_op_names": "recording collectives (doctor/recorder.py)",
    "torch.ops._c10d_functional": "recording functional collectives (doctor/recorder.py)",
    "torch.utils._python_dispatch.TorchDispatchMode": "recording collectives "
                                                      "(doctor/recorder.py)",
    # the recording process group on CPU ranks (doctor/backend.py)
    "torch._C._distributed_c10d._allow_inflight_collective_as_graph_input":
        "the recording group's waits from compiled code (doctor/backend.py)",
    "torch._C._distributed_c10d._register_work":
        "the recording group's Work objects for functional collectives (doctor/backend.py)",
    "torch.distributed.distributed_c10d._create_process_group_wrapper":
        "TORCH_DISTRIBUTED_DEBUG=DETAIL checks on the recording group (doctor/backend.py)",
    "torch.distributed.Backend._plugins": "registering the recording group once (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroup._register_backend":
        "the recording group's gloo backend (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroup._set_default_backend":
        "the recording group's gloo backend (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroupGloo._set_sequence_number_for_group":
        "the recording group's gloo backend, as init_process_group does (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroupGloo._allgather_base":
        "the recording group's all-gathers (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroupGloo._reduce_scatter_base":
        "the recording group's reduce-scatters (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroupGloo._start_coalescing":
        "the recording group's coalesced collectives (doctor/backend.py)",
    "torch._C._distributed_c10d.ProcessGroupGloo._end_coalescing":
        "the recording group's coalesced collectives (doctor/backend.py)",
    # rehearsal of one rank (rehearse/rank.py, memory.py)
    "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._lazy_init":
        "the rehearsal's FSDP2 states initialised before tracking (rehearse/memory.py)",
    "torch.distributed._tools.mem_tracker.MemTracker._update_and_maybe_create_winfos":
        "filing another stage's shards in the rehearsal's tracker (rehearse/memory.py)",
    "torch.Tensor._backward_hooks":
        "the rehearsal's tracker hooks cleared from the inputs (rehearse/tracker_hooks.py)",
    "torch.testing._internal.distributed.fake_pg.FakeStore":
        "the fake process group's store (rehearse/rank.py)",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator":
        "leaving DTensor's metadata propagation out of rehearsed memory (rehearse/memory.py)",
    "torch.distributed.tensor._sharding_prop.ShardingPropagator."
    "_propagate_tensor_meta_non_cached.__code__":
        "leaving DTensor's metadata propagation out of rehearsed memory (rehearse/memory.py)",
    "torch.distributed._tools.mem_tracker.MemTracker": "rehearsed memory (rehearse/memory.py)",
    "torch.distributed._tools.mod_tracker.ModTracker":
        "the rehearsal's module tracker that clears its input hooks (rehearse/tracker_hooks.py)",
    "torch.utils._pytree.tree_flatten":
        "the tensors among a module's inputs (rehearse/tracker_hooks.py)",
    "torch.distributed._tools.mem_tracker._TOTAL_KEY":
        "the rank's peak key of the rehearsal's tracker (rehearse/memory.py)",
    "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker":
        "rehearsed memory under FSDP2 (rehearse/memory.py)",
    "torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType":
        "filing another stage's shards as parameters in the rehearsal's tracker "
        "(rehearse/memory.py)",
    "torch._subclasses.fake_tensor.FakeTensorMode": "rehearsing without allocating "
                                                    "(rehearse/rank.py)",
    # checkpoints
    "torch.distributed.checkpoint.default_planner._EmptyStateDictLoadPlanner":
        "reading a checkpoint without a model (checkpoint/export.py)",
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict":
        "reading a checkpoint without a model (checkpoint/export.py)",
}
"""Dotted symbol -> what needs it."""

PRIVATE_ATTRIBUTES: dict[str, str] = {
    "torch.nn.modules.module:_buffers":
        "buffers moved to the device while the parameters stay on the host (FSDP2's CPU "
        "offload; model/init.py materialize; the attribute scan cannot see it, meshtron "
        "names an attribute _buffers too)",
    "torch.distributed.device_mesh:_pg_registry":
        "releasing a mesh's process groups (parallel/mesh.py; skipped where absent)",
    "torch.distributed.fsdp._fully_shard._fsdp_state:_fsdp_param_groups":
        "compressed gradients' FSDP2 parameter groups (compress/runtime.py; torch 2.13 name)",
    "torch.distributed.fsdp._fully_shard._fsdp_state:_fsdp_param_group":
        "the same on torch before _fsdp_param_groups (2.11)",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper:_checkpoint_wrapped_module":
        "compiling a recomputed block's inner module (parallel/compile.py)",
    "torch.distributed._tools.mem_tracker:_curr_mem_snap": "rehearsed memory (rehearse/memory.py)",
    "torch.distributed._tools.mem_tracker:_peak_mem": "rehearsed memory (rehearse/memory.py)",
    "torch.distributed._tools.mem_tracker:_peak_mem_snap": "rehearsed memory (rehearse/memory.py)",
    "torch.distributed._tools.fsdp2_mem_tracker:_root_mod":
        "rehearsed memory under FSDP2 (rehearse/memory.py)",
}
"""Private attributes torch sets on its objects (instance attributes: no class has them to look
up), "module:attribute" -> what needs it. Present when the module's source still assigns or
reads the name (`attribute_present`); tests/test_torch_compat.py's scan of attribute reads on
torch objects fails on one registered nowhere."""

ONE_OF: tuple[tuple[str, ...], ...] = (
    ("torch.distributed._functional_collectives.all_gather_single",
     "torch.distributed._functional_collectives.all_gather_tensor"),
    ("torch.distributed.pipelining.stage.PipelineStage._forward_metadata_inference",
     "torch.distributed.pipelining.stage.PipelineStage._shape_inference"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state:_fsdp_param_groups",
     "torch.distributed.fsdp._fully_shard._fsdp_state:_fsdp_param_group"),
)
"""Registered symbols of which a torch needs only one: the same thing under its newer and its
older name (2.13 has the first, 2.11 the last; callers feature-detect which)."""


_MISSING = object()


def lookup(symbol: str, default: Any = None) -> Any:
    """The object a dotted `symbol` names on the installed torch, or `default` when it is
    absent: the longest importable module prefix, then attributes."""
    parts = symbol.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, _MISSING)
            if obj is _MISSING:
                return default
        return obj
    return default


def available(symbol: str) -> bool:
    """Whether the installed torch has `symbol` (registered in PRIVATE_APIS)."""
    _registered(symbol)
    return lookup(symbol, _MISSING) is not _MISSING


def require(symbol: str, feature: str) -> Any:
    """`symbol`'s object; UserError (one line: the feature, the torch version, the range
    meshtron supports) when the installed torch lacks it."""
    _registered(symbol)
    obj = lookup(symbol, _MISSING)
    if obj is _MISSING:
        import torch

        raise UserError(f"{feature}: torch {torch.__version__} has no {symbol}, which it needs "
                        f"(meshtron supports torch {SUPPORTED_TORCH}); use another torch or "
                        "turn the feature off")
    return obj


def functional_all_gather(x: Any, gather_dim: int, group: Any) -> Any:
    """Functional (traceable, differentiable) all-gather of `x` along `gather_dim`: the same
    `_c10d_functional.all_gather_into_tensor` op under its 2.13 name `all_gather_single` and
    its 2.11 name `all_gather_tensor` (the H200 image's torch 2.11 lacks the new one)."""
    name = "torch.distributed._functional_collectives."
    fn = lookup(name + "all_gather_single") or require(name + "all_gather_tensor",
                                                       "context parallelism")
    return fn(x, gather_dim, group)


def all_gather_into(out: Any, inp: Any, group: Any = None) -> Any:
    """`out` = the all-gather of `inp` over `group` along dim 0 (c10d's in-place form):
    `all_gather_single` where torch has it (2.13 deprecates the old name),
    `all_gather_into_tensor` before (2.11)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group)


def reduce_scatter_into(out: Any, inp: Any, group: Any = None) -> Any:
    """`out` = this rank's chunk of the SUM of `inp` over `group`: `reduce_scatter_single`
    where torch has it, `reduce_scatter_tensor` before (2.11)."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group)


def attribute_present(entry: str) -> bool:
    """Whether the installed torch's `module` (PRIVATE_ATTRIBUTES' "module:attribute") still
    names `attribute`: a whole-word match in its source file (finding the file imports only
    its parent packages)."""
    import importlib.util
    import re

    module, attribute = entry.split(":")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    with open(spec.origin, encoding="utf-8") as f:
        return re.search(rf"\b{re.escape(attribute)}\b", f.read()) is not None


def present(name: str) -> bool:
    """Whether the installed torch has a PRIVATE_APIS symbol or a PRIVATE_ATTRIBUTES entry."""
    return attribute_present(name) if ":" in name else lookup(name, _MISSING) is not _MISSING


def missing() -> list[str]:
    """Registered symbols (and private attributes) the installed torch lacks, but for one of
    ONE_OF's names where another of its names is there."""
    absent = [s for s in (*PRIVATE_APIS, *PRIVATE_ATTRIBUTES) if not present(s)]
    covered = {s for names in ONE_OF if set(names) - set(absent) for s in names}
    return [s for s in absent if s not in covered]


def _registered(symbol: str) -> None:
    if symbol not in PRIVATE_APIS:
        raise KeyError(f"{symbol}: not in meshtron.torch_compat.PRIVATE_APIS")
