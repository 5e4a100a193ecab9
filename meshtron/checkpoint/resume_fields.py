"""What `--resume` does with every setting of a run: one decision per field, in one table.

- KEEP: shapes the trajectory (or what the checkpoint's state means). Omitted on the resume
  command: the checkpoint's recorded value is used. Given with another value: refused (one line
  naming the field, the recorded and the given value; exit 2, nothing written).
- FOLLOW: omitted: the recorded value is used; given: the new value is used (changing it on
  resume is supported and changes no step's result).
- EXTEND: omitted: the recorded value is used; given with another value: allowed when every
  step the checkpoint took had the same learning rate under both (the run then continues
  exactly as one started with the new value), else refused naming the first step whose rate
  differs (meshtron/checkpoint/extend.py).
- LAYOUT: how the ranks run the step: the checkpoint's own plan when the resume command gives
  no layout, knob, cluster or compression flag and the world has the run's size
  (meshtron/train/planning.py `_resumed_plan`), else planned again for the resumed world
  (resharded resume: any layout or number of ranks continues the same trajectory).
- ARG: not a setting of the run (how it is found, or set by meshtron itself).

The number of ranks is FOLLOW (meshtron/train/resume_args.py `resumed_nproc`: the recorded
world size unless --nproc is given); under int8 compression `plan.zero` stays in the recorded
ZeRO family (resume.residual_zero).

As Megatron-LM treats a resumed job (megatron/training/checkpointing.py: `check_checkpoint_args`
refuses a model argument that differs from the checkpoint's; `--use-checkpoint-args`,
`load_args_from_checkpoint`, takes the checkpoint's arguments): the run keeps its own settings
unless the user changes one that may change. tests/test_resume_config.py
fails on a field of RunConfig, CheckpointConfig or Plan that has no decision here.
"""

from __future__ import annotations

KEEP, FOLLOW, EXTEND, LAYOUT, ARG = "keep", "follow", "extend", "layout", "arg"

_SCHEDULE = "the learning-rate schedule is a function of it"
"""meshtron/config.py `OptimConfig.lr_factor`: warm-up, then cosine decay to min_lr_ratio * lr at
train.steps. The checkpoint holds the schedule's position, not its shape: another value would
silently jump the learning rate at the resumed step (--steps 12 -> 20 moved it from 2.07e-4 to
5.39e-4). As Megatron-LM's scheduler checks (`--override-opt_param-scheduler` to bypass) and
torchtitan's schedule being a function of the configured steps, a change must be explicit: a new
run. train.steps itself may change where the steps taken keep their rate (EXTEND)."""
_DATA = "the data position it holds counts windows of that data"
"""Sample n of the shuffled seq_len+1-token windows of that source as that tokenizer splits it
(meshtron/data/dataset.py)."""
_STEP = "it changes every later step's update"
_STATE = "the checkpoint's state was trained with it"

FIELDS: dict[str, tuple[str, str]] = {
    # RunConfig (meshtron/config.py); the model's shape is one entry, checked field by field
    "model": (KEEP, "the checkpoint's tensors have its shapes"),
    "data.source": (KEEP, _DATA),
    "data.tokenizer": (KEEP, _DATA),
    "data.json_key": (KEEP, _DATA),
    "data.bpe_vocab": (KEEP, _DATA),
    "data.seq_len": (KEEP, _DATA),
    "data.global_batch": (KEEP, "the data position it holds counts batches of that size"),
    "data.micro_batch": (KEEP, _STEP),
    "data.eval_batches": (FOLLOW, "held-out batches only"),
    "data.attention_mask": (KEEP, _STEP),
    "optim.lr": (KEEP, _SCHEDULE),
    "optim.min_lr_ratio": (KEEP, _SCHEDULE),
    "optim.warmup_steps": (KEEP, _SCHEDULE),
    "optim.weight_decay": (KEEP, _STEP),
    "optim.beta1": (KEEP, _STATE),
    "optim.beta2": (KEEP, _STATE),
    "optim.eps": (KEEP, _STEP),
    "optim.grad_clip": (KEEP, _STEP),
    "train.steps": (EXTEND, "the learning-rate schedule ends at it; the steps taken must keep "
                            "their rate"),
    "train.dtype": (KEEP, _STATE),
    "train.fp8_recipe": (KEEP, _STATE),
    "train.compile": (FOLLOW, "a per-block compile of the same step"),
    "train.seed": (KEEP, "the weights and the data order it holds come from it"),
    "train.eval_every": (FOLLOW, "evaluation only"),
    "train.log_every": (FOLLOW, "metrics lines only"),
    "train.run_dir": (ARG, "where the run is"),
    "train.tensorboard": (FOLLOW, "an extra record only"),
    "train.init_from": (KEEP, "the run's base (meshtron merge reads it)"),
    "train.export": (FOLLOW, "where the final weights go"),
    "train.replica_ft": (KEEP, _STATE),
    "train.run_id": (ARG, "set by meshtron: a new run's random id, the checkpoint's on resume"),
    # CheckpointConfig (meshtron/checkpoint/config.py): the run's safety; recorded in meta.json
    "checkpoint.every": (FOLLOW, "the save interval"),
    "checkpoint.keep": (FOLLOW, "retention"),
    "checkpoint.resume": (ARG, "the flag itself"),
    "checkpoint.max_restarts": (FOLLOW, "restarts"),
    "checkpoint.preempt_grace_s": (FOLLOW, "the notice before a preemption"),
    "checkpoint.mtbf_hours": (FOLLOW, "the automatic interval's input"),
    "checkpoint.snapshot_every": (FOLLOW, "in-memory snapshots"),
    "checkpoint.residuals": (FOLLOW, "what later checkpoints hold of error feedback (the "
                             "checkpoint resumed from is read as it was saved)"),
    "checkpoint.resume_if_any": (ARG, "set by an elastic rank"),
    "checkpoint.override_lr_schedule": (ARG, "this resume's choice (checkpoint/extend.py)"),
    # Plan (meshtron/planner/plan.py): the data-parallel traffic shapes the trajectory (DiLoCo's
    # rounds, int8 error feedback held in the checkpoint); the layout is re-planned
    "plan.grad_compression": (KEEP, _STATE),
    "plan.grad_compression_block": (KEEP, _STATE),
    "plan.compress_scope": (KEEP, _STATE),
    "plan.diloco": (KEEP, _STATE),
    "plan.outer_lr": (KEEP, _STEP),
    "plan.outer_momentum": (KEEP, _STATE),
    "plan.ranks_per_node": (LAYOUT, "the resumed machines' node size"),
    **{f"plan.{name}": (LAYOUT, "re-planned for the resumed world") for name in (
        "tp", "pp", "dp", "zero", "micro_batch", "recompute", "sp", "schedule",
        "virtual_stages", "stage_layers", "dp_replicate", "attention", "cluster", "cp",
        "reduce_dtype", "accumulate_unsharded", "ep", "etp", "compile", "async_tp", "offload",
        "offload_activations", "pipeline_runs")},
    # what a saved plan was priced for (planner/plan_priced.py): meshtron's runtime runs only
    # its own preset's plans, and a resumed world is re-planned (priced) anew
    **{f"plan.{name}": (LAYOUT, "the pricing of the re-planned layout") for name in (
        "framework", "framework_options")},
    # a Plan's context, mirrored from the run config (checked there: model, data.global_batch,
    # data.seq_len, train.dtype, train.fp8_recipe)
    **{f"plan.{name}": (ARG, "mirrors the run config") for name in (
        "model", "global_batch", "seq_len", "dtype", "fp8_recipe", "predicted")},
}


def decision(key: str) -> str:
    return FIELDS[key][0]


def kept(prefix: str) -> list[str]:
    """The KEEP fields under `prefix` ('data', 'plan', ...), without the prefix."""
    return [k.split(".", 1)[1] for k, (d, _) in FIELDS.items()
            if d == KEEP and k.startswith(prefix + ".")]


def inherited(prefix: str) -> list[str]:
    """The fields under `prefix` a resume takes from the record when not given (KEEP, FOLLOW,
    EXTEND)."""
    return [k.split(".", 1)[1] for k, (d, _) in FIELDS.items()
            if d in (KEEP, FOLLOW, EXTEND) and k.startswith(prefix + ".")]
