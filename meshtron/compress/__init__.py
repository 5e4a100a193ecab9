"""Less data-parallel communication: compressed gradient reduction and DiLoCo.

- `quant`: block-wise absmax int8 and bf16 codecs;
- `collectives`: compressed reduce-scatter / all-reduce (ZeRO++ qgZ style) with error feedback,
  flat or hierarchical (fp32 inside a node, compressed across nodes);
- `runtime`: the hook into a ParallelModel per ZeRO stage (plan.grad_compression);
- `diloco`: DiLoCo's outer loop over data-parallel replicas (plan.diloco);
- `cost`: the planner's view of both (torch-free, like the planner);
- `cli`: the `meshtron train` flags.

Nothing is imported here, so the planner can use `cost` without importing torch.
"""
