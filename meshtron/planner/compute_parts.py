"""What a layer's and an edge's (embedding, head) seconds are made of: the cost records the
planner sums (`LayerCost`, `EdgeCost`, by kind: PART_KINDS), the dtype each part computes in,
and the share of a forward pass that recomputation runs again. planner/compute.py prices a
layer into a LayerCost, planner/compute_edges.py the embedding and the head into EdgeCosts."""

from __future__ import annotations

from dataclasses import dataclass

PART_KINDS = ("gemm", "attention", "elementwise", "fp8_cast", "host_wait")
"""What a layer's or an edge's compute seconds are made of: GEMMs (block linears, the head),
the attention core, memory-bound kernels, FP8 quantisation, and the GPU waiting on the host's
launches (host.launch_bound) or its synchronisations."""


@dataclass(frozen=True)
class LayerCost:
    """Seconds one GPU spends on one transformer layer for one micro-batch."""

    fwd: float
    """Forward compute (GEMMs, attention core, memory-bound kernels)."""
    bwd: float
    """Backward compute (input and weight gradients)."""
    wgrad: float
    """Part of `bwd` that computes weight gradients (deferrable by zero-bubble schedules)."""
    linear_fwd: float
    """Part of `fwd` that runs the block GEMMs (what a selective policy that keeps matmul
    outputs does not run again). Equal to `wgrad` unless the backward GEMMs run another
    kernel than the forward one (FP8 without fast accumulation:
    KernelOptions.fp8_split_accum_bwd)."""
    core_fwd: float
    """Forward of the attention core alone (what selective recomputation repeats)."""
    tp_fwd: float
    """Tensor-parallel communication of the forward pass (2 all-reduces, or RS+AG with SP)."""
    tp_bwd: float
    """Tensor-parallel communication of the backward pass."""
    parts: tuple[tuple[str, float, float], ...] = ()
    """(kind, forward seconds, backward seconds) that `fwd` and `bwd` are the sums of, kind
    one of PART_KINDS: where the layer's time goes, for planner/step_categories.py."""
    recomputable: tuple[tuple[str, str, float], ...] = ()
    """(piece, kind, forward seconds) of what fine-grained recomputation can run again in the
    backward (elementwise.recomputed_bytes names the pieces; 'up_proj' also has the
    up-projection GEMMs, kind 'gemm'): priced by `fine_recompute`."""

    def fine_recompute(self, norms: bool, up_proj: bool, act: bool,
                       recompute: str) -> dict[str, float]:
        """Seconds by kind that the backward of one micro-batch spends running again the
        pieces MemoryOptions' recompute_norms (`norms`), recompute_up_proj (`up_proj`) and
        swiglu_recompute (`act`) drop from memory: the block norms (and MLA's latent norms,
        which the up-projections' checkpoint otherwise runs: Megatron-Core core_v0.14.0
        multi_latent_attention.py `qkv_up_proj_and_rope_apply` normalises the latents inside
        it), the up-projections with their RoPE, the MLP activation. Blocks whose whole forward
        is replayed (recompute 'full', half the blocks of 'half': `recompute_share`) run them
        there already."""
        wanted = set()
        if norms:
            wanted |= {"norms", "latent_norms"}
        if up_proj:
            wanted |= {"up_proj", "latent_norms"}
        if act:
            wanted.add("act")
        scale = 1.0 - recompute_share(recompute)
        out: dict[str, float] = {}
        for piece, kind, s in self.recomputable:
            if piece in wanted and scale > 0.0:
                out[kind] = out.get(kind, 0.0) + scale * s
        return out

    def parts_per_microbatch(self, recompute: str, attention: str) -> dict[str, float]:
        """`parts` over one micro-batch's forward, backward and what recomputation repeats,
        by kind: they add up to `per_microbatch`'s compute."""
        share = recompute_share(recompute)
        out = {kind: f * (1.0 + share) + b for kind, f, b in self.parts}
        if recompute == "selective" and attention == "unfused":
            out["attention"] = out.get("attention", 0.0) + self.core_fwd
        return out

    def per_microbatch(self, recompute: str, attention: str) -> tuple[float, float, float, float]:
        """(compute, tp comm, forward part, weight-grad part) of fwd+bwd with recomputation."""
        compute = self.fwd + self.bwd
        tpc = self.tp_fwd + self.tp_bwd
        share = recompute_share(recompute)
        if share:
            compute += share * self.fwd
            tpc += share * self.tp_fwd
        elif recompute == "selective" and attention == "unfused":
            compute += self.core_fwd
        return compute, tpc, self.fwd + self.tp_fwd, self.wgrad


@dataclass(frozen=True)
class EdgeCost:
    """Seconds for the embedding (first stage) or the final norm + LM head + loss (last stage)."""

    compute: float
    """Forward + backward compute for one micro-batch."""
    tp: float
    """Tensor-parallel communication for one micro-batch."""
    fwd: float
    """Forward part (compute + comm) of the above."""
    wgrad: float
    """Weight-gradient part of `compute`."""
    parts: tuple[tuple[str, float], ...] = ()
    """(kind, seconds) that `compute` is the sum of, kind one of PART_KINDS."""


def compute_dtypes(dtype: str) -> tuple[str, str]:
    """(dtype of the blocks' linear GEMMs, dtype of everything else): FP8 recipes (Transformer
    Engine's fp8_autocast around the blocks' Linear layers, torchao float8 on nn.Linear in the
    blocks) keep the attention core, the output head and the small GEMMs in bf16."""
    if dtype == "fp8":
        return "fp8", "bf16"
    return dtype, dtype


def recompute_share(recompute: str) -> float:
    """Forward passes recomputation runs again per block, on the mean: 1 with 'full' (Chen et
    al. 2016), 0.5 with 'half' (every second block checkpointed, parallel/recompute.py), 0
    otherwise ('selective' repeats only the unfused attention core: LayerCost.core_fwd). A
    model part's own count: `replayed_blocks`."""
    return {"full": 1.0, "half": 0.5}.get(recompute, 0.0)


def replayed_blocks(recompute: str, blocks: int) -> float:
    """Blocks whose forward the backward of one model part of `blocks` blocks (a pipeline
    stage's chunk, the whole model without a pipeline) runs again: `half` checkpoints the
    part's blocks 1, 3, ... (parallel/recompute.py, `i % 2 == 1` over the part's own
    blocks), blocks // 2 of them: half a block fewer than `recompute_share`'s mean on an odd
    part; the others the mean."""
    if recompute == "half":
        return float(blocks // 2)
    return recompute_share(recompute) * blocks
