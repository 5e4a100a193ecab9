"""Composer's training metrics, as llm-foundry's MPT runs them (KernelOptions `train_metrics`):
what they cost each micro-batch on the GPU and each step on the host. Torch-free.

Which metrics: llm-foundry's `ComposerMPTCausalLM` (llmfoundry/models/mpt/modeling_mpt.py at
5e85bd62d, the January 2024 benchmark commit, and v0.3.0 alike) builds its train metrics as
`[LanguageCrossEntropy(), LanguagePerplexity()]` unless the model config sets
`use_train_metrics: false` (no benchmark yaml does): two torchmetrics `Metric`s, each with the
states `sum_loss` (float32 scalar) and `total_items` (int64 scalar)
(composer/metrics/nlp.py, mosaicml/composer v0.16.3 to v0.17.2).

Every micro-batch, after its backward (composer/trainer/trainer.py `_train_microbatch` ->
`_eval_train_metrics`, under torch.no_grad() and the run's autocast): each metric's update
runs `torch.nn.CrossEntropyLoss(reduction='sum')` on the whole [tokens, V] logits the forward
returned (HuggingFaceModel.eval_forward hands back `outputs['logits']`). Under bf16 autocast
`log_softmax` runs with dtype float32 (autocast's fp32_set_opt_dtype policy): one pass that
reads the 16-bit logits and writes fp32 log-probabilities, 2 + 4 bytes per logit
(`METRIC_BYTES_PER_LOGIT`); nll_loss then reads one value per token. No backward.

Every step, at the batch's end (`_train_loop` -> `_compute_and_log_metrics`, after the loss
all-reduce and `.item()` have emptied the GPU's queue): each metric's `compute()` synchronises
its states over the whole world (torchmetrics `Metric.sync` -> `_sync_dist` with
`gather_all_tensors`, torchmetrics v1.0.3, the newest Composer 0.17's pin
'torchmetrics>=0.10.0,<1.1' admits; src/torchmetrics/utilities/distributed.py). For each
scalar state: `torch.distributed.barrier()` (ProcessGroupNCCL: an all-reduce of one element,
then the host waits for the device), a Python list of `world` `torch.zeros_like` tensors (one
no-grad op and one fill launch each), and `all_gather` into that list, whose ProcessGroupNCCL
path (torch 2.1 ProcessGroupNCCL.cpp `allgather`, same-size outputs) gathers into one flat
buffer and then issues one `copy_` per rank into the list. The GPU is idle meanwhile: the
host's issue of 2 x world operations per state is the step's time (`sync_s`), and it grows
with the world size (4 states on DGX H100: 36.9 ms a step at 512 ranks, 9.7 ms at 128).

The mechanism is known elsewhere (no figure of theirs is used here): composer#3411 (2024)
asks for train metrics at a lower frequency because Composer evaluates them every batch;
AnswerDotAI/ModernBERT#97 (Composer, one 8xH100 node) measured about 3% of step time from
three train metrics; allenai/OLMo#279 (2023) replaced a torchmetrics loss metric by one
dist.reduce because its all_gather sync cost "a lot of time".
"""

from __future__ import annotations

from meshtron.planner import comm, host
from meshtron.planner.cluster import ClusterSpec

METRIC_BYTES_PER_LOGIT = 2.0 + 4.0
"""HBM bytes per logit of one metric update (module docstring): log_softmax reads the bf16
logits and writes fp32 under autocast; nll_loss's reads of one value per token are left out."""
STATES_PER_METRIC = 2
"""Scalar states per metric that `compute()` gathers: sum_loss and total_items."""
STATE_BYTES = 8.0
"""Bytes per rank of a gathered state (int64 total_items; float32 sum_loss: 4)."""
ZEROS_LIKE_S = (host.NO_GRAD_DISPATCH_US + host.LAUNCH_US) * 1e-6
"""Host time of one Python `torch.zeros_like` on the GPU: a no-grad op and its fill launch."""
COPY_S = host.LAUNCH_US * 1e-6
"""Host time of one `copy_` ProcessGroupNCCL issues from C++ per gathered rank (the CUDA
dispatch and launch path, without Python's)."""


def update_bytes(metrics: int, logits: float) -> float:
    """HBM bytes the metrics' updates move per micro-batch over `logits` logits."""
    return metrics * METRIC_BYTES_PER_LOGIT * logits


def state_sync_s(world: int, gpus_per_node: int, fab: comm.Fabric) -> float:
    """Seconds of one scalar state's gather_all_tensors over `world` ranks: the barrier (an
    all-reduce of one element and the host's wait), the zeros_like list, and the all_gather
    beside the host's per-rank copies (the host issues them while the gather runs)."""
    if world <= 1:
        return 0.0
    group = comm.Group(world, min(world, gpus_per_node))
    barrier = comm.all_reduce(1.0, group, fab) + host.SYNC_S
    gather = comm.all_gather(STATE_BYTES * world, group, fab)
    return barrier + world * ZEROS_LIKE_S + max(gather, world * COPY_S)


def sync_s(metrics: int, world: int, cluster: ClusterSpec) -> float:
    """Seconds per step the GPU waits while `metrics` torchmetrics metrics of two scalar states
    each are computed (synchronised over `world` ranks) at the batch's end."""
    if metrics <= 0 or world <= 1:
        return 0.0
    fab = comm.Fabric.of(cluster)
    return metrics * STATES_PER_METRIC * state_sync_s(world, cluster.gpus_per_node, fab)
