"""`meshtron train` and `meshtron demo`: the command line, turned into a typed `TrainJob`.

Everything here is argument parsing and validation; bad input raises `UserError` (one line,
exit code 2, printed by meshtron/cli.py). The job then runs in `meshtron.train.launch`.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshtron.argtypes import folder_problem, literal_value, positive_float, positive_int
from meshtron.config import RunConfig, apply_overrides, config_from_dict, load_toml
from meshtron.errors import UserError
from meshtron.train.job import ParallelRequest, TrainJob

# CLI flag -> dotted config key. Flags left unset do not override the TOML file.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, "preset name or path to a Hugging Face config.json"),
    "--data": ("data.source", str, "'stdlib', a text file/folder, a .jsonl (or .json) of "
              "{\"text\": ...} lines or a .bin token shard"),
    "--json-key": ("data.json_key", str, "the field of each JSON Lines record that holds its "
                   "text (Megatron's --json-keys; default: text)"),
    "--tokenizer": ("data.tokenizer", str, "byte | bpe | a tokenizer.json (or its folder); "
                    "default: --init-from's tokenizer.json if it has one, else byte"),
    "--seq-len": ("data.seq_len", int, "tokens per sequence"),
    "--global-batch": ("data.global_batch", int, "sequences per optimizer step"),
    "--micro-batch": ("data.micro_batch", int, "sequences per forward/backward (accumulation)"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--warmup-steps": ("optim.warmup_steps", int, "linear warm-up steps"),
    "--steps": ("train.steps", int, "optimizer steps"),
    "--dtype": ("train.dtype", str, "fp32 | bf16 | fp8 (default: bf16 on CUDA, fp32 on CPU, a "
                "saved plan's; fp8: torchao float8, emulated on CPU)"),
    "--fp8-recipe": ("train.fp8_recipe", str, "rowwise | tensorwise (FP8 scaling, with --dtype "
                     "fp8)"),
    "--seed": ("train.seed", int, "seed of weights and data order"),
    "--eval-every": ("train.eval_every", int, "eval period in steps (0: off)"),
    "--log-every": ("train.log_every", int, "metrics line (and host sync) every N steps"),
    "--run-dir": ("train.run_dir", str, "output folder"),
    "--attention-mask": ("data.attention_mask", str, "causal | document (packed documents)"),
    "--init-from": ("train.init_from", str, "Hugging Face checkpoint folder to start from"),
    "--export": ("train.export", str, "write the final weights here as a Hugging Face folder"),
    "--replica-ft": ("train.replica_ft", int, "G replica groups with per-step fault tolerance "
                     "(torchft; --max-restarts R replacements rejoin with the live weights)"),
}
# Run-file keys a saved plan fixes: taken from the plan when not given, checked when given.
_PLAN_FIXES = {"data.global_batch": "global_batch", "data.seq_len": "seq_len"}


SCHEDULES = "gpipe[:V] | 1f1b | interleaved[:V] | zb | zbv"
"""The pipeline schedules `--schedule` offers (V: virtual stages per rank); every one trains and
evaluates (tests/test_pipeline_cli.py runs each through this command)."""


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="RUN.toml", help="TOML run file (flags override it)")
    for flag, (key, typ, text) in _FLAGS.items():
        p.add_argument(flag, type=typ, dest=key.replace(".", "__"), metavar=typ.__name__.upper(),
                       help=f"{text} [{key}]")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.beta2=0.99 (repeatable)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of a run already in --run-dir (refused otherwise)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (after TP and recomputation, "
                        "before FSDP); compile time is reported apart from step time "
                        "[train.compile]")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to RUN_DIR/tensorboard "
                        "[train.tensorboard]")


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (any of these runs the job on torch.distributed)")
    g.add_argument("--nproc", type=positive_int,
                   help="local ranks to start with torchrun (standalone); inside an existing "
                        "torchrun/srun world its size is used")
    g.add_argument("--plan", help="'auto' (ask the planner), a layout 'tp=2,pp=2,dp=2' of "
                   "tp, cp, pp, dp, dp_replicate (HSDP: dp=4,dp_replicate=2), ep (open "
                   "knobs are chosen by the planner), or a plan.toml from `meshtron plan --save` "
                   "(which also sets the global batch, sequence length and, if not given, the "
                   "model)")
    g.add_argument("--cluster", help="cluster to plan for: a preset like dgx-h100:1 or "
                   "nominal-cpu:4, or a TOML file (default: this machine's `meshtron calibrate` "
                   "file)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage over the data axis")
    g.add_argument("--schedule", help=f"pipeline schedule: {SCHEDULES}")
    g.add_argument("--recompute", choices=["none", "selective", "half", "full"],
                   help="activation recomputation")
    g.add_argument("--sp", choices=["on", "off"], help="sequence parallelism (with tp > 1)")
    g.add_argument("--offload", choices=["none", "optimizer", "full"],
                   help="host offload: full = FSDP2 CPU offload of parameter, gradient and "
                        "optimizer-state shards (zero 2/3); optimizer = ZeRO-Offload (planned "
                        "only)")
    g.add_argument("--async-tp", action="store_true",
                   help="asynchronous tensor parallelism: TP all-gathers/reduce-scatters "
                        "micro-pipelined with the matmuls (CUDA + NCCL; needs --compile, tp > 1 "
                        "and sequence parallelism)")
    g.add_argument("--offload-activations", action="store_true",
                   help="keep the activations saved for backward in (pinned) host memory")
    g.add_argument("--watchdog-timeout", type=positive_float, metavar="S",
                   help="abort when a rank makes no progress for S seconds (longer before the "
                        "first step): every rank dumps RUN_DIR/trace for `meshtron doctor`")
    g.add_argument("--no-recorder", action="store_true",
                   help="do not record collectives (the trace then holds stacks only)")
    g.add_argument("--launched-rank", action="store_true", help=argparse.SUPPRESS)
    from meshtron.compress.cli import add_arguments as add_compress_arguments

    add_compress_arguments(p.add_argument_group("less communication (meshtron/compress)"))


def add_checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("surviving failures (meshtron.checkpoint)")
    g.add_argument("--checkpoint-every", metavar="N|auto",
                   help="save a sharded asynchronous checkpoint every N steps (0: off, the "
                        "default), or 'auto' (Young/Daly optimum from the measured save stall "
                        "and the MTBF); with --resume, the run's own unless given")
    g.add_argument("--keep", type=int, metavar="K",
                   help="complete checkpoints kept (default 3; with --resume, the run's own)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest complete checkpoint in RUN_DIR/checkpoints, "
                        "with the run's own settings where none is given (a setting that "
                        "would change its trajectory is refused; the layout may change)")
    g.add_argument("--override-lr-schedule", action="store_true",
                   help="with --resume and another --steps: continue on the new --steps' "
                        "learning-rate schedule from the checkpoint's step even where the steps "
                        "taken had another rate (the rate jumps; refused without it)")
    g.add_argument("--max-restarts", type=int, metavar="R",
                   help="restart all ranks from the last checkpoint when one dies, up to R "
                        "times (torchrun's elastic agent; default 0)")
    g.add_argument("--preempt-grace", type=float, metavar="S",
                   help="seconds from SIGTERM to the committed checkpoint; the run then exits "
                        "with code 75 (default 30)")
    g.add_argument("--snapshot-every", type=int, metavar="N",
                   help="keep an in-memory snapshot every N steps (own shard + a copy on the "
                        "next node of --ranks-per-node ranks; needs --max-restarts): a restart "
                        "restores from memory before disk (0: off, the default)")
    g.add_argument("--checkpoint-residuals", choices=("own", "mean"),
                   help="what checkpoints hold of --grad-compression's error feedback: own "
                        "(default: each rank's residual and their mean; a resume continues bit "
                        "for bit; 4 bytes per parameter per data-parallel rank) or mean (the "
                        "mean only, 4 bytes per parameter; a resume continues close to it)")
    g.add_argument("--mtbf-hours", type=float, metavar="H",
                   help="the job's mean time between failures for --checkpoint-every auto "
                        "(default: from the GPU count and Llama 3's per-GPU failure rate)")


# CheckpointConfig field -> the flag's argparse dest (None when not given)
_CHECKPOINT_FLAGS = {"every": "checkpoint_every", "keep": "keep", "max_restarts": "max_restarts",
                     "preempt_grace_s": "preempt_grace", "mtbf_hours": "mtbf_hours",
                     "snapshot_every": "snapshot_every", "residuals": "checkpoint_residuals"}


def checkpoint_config(args: argparse.Namespace, resumed: tuple[Any, dict] | None = None):
    """The checkpoint flags; those not given: what the resumed checkpoint's meta.json records
    (`resumed`: resume_args.check_given), else CheckpointConfig's defaults."""
    from meshtron.checkpoint.config import CheckpointConfig, parse_every
    from meshtron.checkpoint.resume import recorded_checkpointing

    values = recorded_checkpointing(resumed[1]) if resumed else {}
    for name, dest in _CHECKPOINT_FLAGS.items():
        given = getattr(args, dest)
        if given is not None:
            values[name] = parse_every(given) if name == "every" else given
    return CheckpointConfig(resume=args.resume, override_lr_schedule=args.override_lr_schedule,
                            **values)


def run_config(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> RunConfig:
    """The run file (or `defaults`), then flags and --set, then a saved plan's batch geometry."""
    doc = load_toml(args.config) if args.config else dict(defaults or {})
    overrides = {key: getattr(args, key.replace(".", "__")) for key, *_ in _FLAGS.values()}
    for item in args.set:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. optim.lr=1e-3")
        key, value = item.split("=", 1)
        if key != "model" and "." not in key:
            raise UserError(f"--set {key!r}: expected SECTION.KEY (data, optim or train)")
        overrides[key] = literal_value(value)
    from meshtron.train.resume_args import over_recorded

    doc = over_recorded(args, doc, overrides)  # --resume: what is not given, the run's own
    if args.tensorboard:
        overrides["train.tensorboard"] = True
    if getattr(args, "compile", False):
        overrides["train.compile"] = True
    from meshtron.train.planning import is_plan_file

    if is_plan_file(getattr(args, "plan", None)):
        _take_from_plan(args.plan, doc, overrides)
    table = doc.get("train")
    if overrides.get("train.dtype") is None and not (isinstance(table, dict)
                                                     and "dtype" in table):
        from meshtron.calibrate.device import default_dtype

        overrides["train.dtype"] = default_dtype()  # bf16 on CUDA, fp32 on CPU
    init_from = overrides.get("train.init_from") or (
        table.get("init_from") if isinstance(table, dict) else None)
    if init_from:
        _follow_init_from(str(init_from), doc, overrides)
    from meshtron.data.tokenizer import follow_tokenizer
    from meshtron.model.hf_variants import check_runtime
    from meshtron.model.shapes import runtime_refusal

    doc = apply_overrides(doc, overrides)
    try:
        cfg = config_from_dict(doc)
    except UserError:
        from meshtron.train.resume_args import refuse_model_change

        refuse_model_change(args, doc)  # --resume on another model: that is the cause
        raise
    cfg = follow_tokenizer(cfg)
    # what the planner prices but no rank runs: the planned-only features' first refusal,
    # then the fields' (the order `meshtron plan` names them, planner/cli.py)
    problem = runtime_refusal(cfg.model)
    if problem:
        raise UserError(problem)
    check_runtime(cfg.model)
    from meshtron.data.pipeline import check_source_key

    check_source_key(cfg.data.source, cfg.data.json_key)  # before any rank reads
    return cfg


def _follow_init_from(init_from: str, doc: dict[str, Any], overrides: dict[str, Any]) -> None:
    """What `train.init_from`'s folder brings when the run does not say otherwise: the model
    (its config.json) and the tokenizer (its tokenizer.json: the ids the weights were trained
    on; the byte tokenizer's ids would index unrelated embedding rows)."""
    from pathlib import Path

    from meshtron.data.tokenizer import tokenizer_file

    _refuse_run_folder(init_from)
    takes_model = overrides.get("model") is None and "model" not in doc
    if takes_model:
        _refuse_missing_folder(init_from)
        overrides["model"] = init_from  # the checkpoint's config.json
    data = doc.get("data")
    given = overrides.get("data.tokenizer") is not None or (
        isinstance(data, dict) and "tokenizer" in data)
    if given:
        return
    if tokenizer_file(init_from) is not None:
        overrides["data.tokenizer"] = init_from
    elif Path(init_from, "tokenizer.model").is_file():  # a SentencePiece model only
        raise UserError(f"train.init_from={init_from!r}: its tokenizer is a SentencePiece "
                        "tokenizer.model, which meshtron does not read; save its tokenizer.json "
                        "(transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) "
                        "or give --tokenizer (byte: train these weights on byte ids)")


def _refuse_missing_folder(init_from: str) -> None:
    """A missing --init-from folder, or one without config.json, when the model comes from it:
    named as `train.init_from`, where it was refused as "model='PATH': file does not exist", a
    field the user never gave (session-52 user audit). Only then: with the model given, the
    weights are read (and a missing folder named) only when no checkpoint is resumed."""
    from pathlib import Path

    folder = Path(init_from)
    if (problem := folder_problem(folder)) is not None:
        raise UserError(f"train.init_from={init_from!r}: {problem} (a Hugging Face "
                        "checkpoint folder holds config.json and *.safetensors)")
    if not (folder / "config.json").is_file():
        raise UserError(f"train.init_from={init_from!r}: holds no config.json (the model its "
                        "weights are for); allowed: a Hugging Face checkpoint folder "
                        "(config.json and *.safetensors), or the model given as --model")


def _refuse_run_folder(init_from: str) -> None:
    """A meshtron run folder given as --init-from (its config.json is the run's record, its
    checkpoints DCP shards) was refused as "config.json model_type=None: supported model types
    are ...": name what it is and the two ways on (session-50 user audit)."""
    from pathlib import Path

    folder = Path(init_from)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    if (folder / "run.toml").is_file() or (folder / "checkpoints").is_dir():
        raise UserError(f"train.init_from={init_from!r}: a meshtron run folder (DCP "
                        "checkpoints, not Hugging Face weights); allowed: a weights folder "
                        f"(`meshtron export {init_from}` writes one from its checkpoint), or "
                        f"--resume --run-dir {init_from} to continue that run")


def _take_from_plan(path: str, doc: dict[str, Any], overrides: dict[str, Any]) -> None:
    """A saved plan fixes the global batch and the sequence length (and the model when none is
    given): flags and the run file may restate them, not contradict them."""
    from meshtron.planner.plan import load_plan, runtime_problem

    import tomllib
    from pathlib import Path

    plan = load_plan(path)
    if runtime_problem(plan):
        # a plan meshtron's runtime does not run at any world size (another stack's, or
        # options it does not run): the validity function's line, as `meshtron plan --save`
        # words it, before the world size it asks for is checked
        plan.validate(plan.gpus)
    fixes = dict(_PLAN_FIXES)
    # A plan that states its precision runs in it (meshtron-plan/1 files had none: the run's
    # dtype decides there).
    saved = tomllib.loads(Path(path).read_text())
    if "dtype" in saved:
        fixes["train.dtype"] = "dtype"
    if "fp8_recipe" in saved:
        fixes["train.fp8_recipe"] = "fp8_recipe"
    if saved.get("compile"):  # a compiled plan runs compiled (--compile may restate it)
        overrides["train.compile"] = True
    for key, name in fixes.items():
        section, field = key.split(".")
        given = overrides.get(key)
        if given is None:
            table = doc.get(section)
            given = table.get(field) if isinstance(table, dict) else None
        want = getattr(plan, name)
        if given is None:
            overrides[key] = want
        elif given != want:
            raise UserError(f"{key}={given!r}: the saved plan {path} has {name}={want}; "
                            "drop the flag or edit the plan")
    _take_grad_clip(plan, path, doc, overrides)
    if overrides.get("model") is None and "model" not in doc:
        overrides["model"] = plan.model


def _take_grad_clip(plan, path: str, doc: dict[str, Any], overrides: dict[str, Any]) -> None:
    """A plan priced with `grad_clip = false` (its [framework_options]: no norm and scale
    passes in the optimizer step, estimate.py) trains unclipped: optim.grad_clip = 0 when the
    run does not set it; a run that sets it the other way is refused in one line (the plan
    says whether to clip, not the threshold, so `true` keeps the run's)."""
    priced = dict(plan.framework_options or ()).get("grad_clip")
    if not isinstance(priced, bool):
        return
    given = overrides.get("optim.grad_clip")
    if given is None:
        table = doc.get("optim")
        given = table.get("grad_clip") if isinstance(table, dict) else None
    if given is None:
        if not priced:
            overrides["optim.grad_clip"] = 0.0
        return
    if isinstance(given, (int, float)) and (given > 0) != priced:
        raise UserError(f"optim.grad_clip={given!r}: the saved plan {path} was priced with "
                        f"grad_clip = {'true' if priced else 'false'} "
                        f"({'clipping' if priced else 'no clipping'}); set optim.grad_clip "
                        f"{'> 0' if priced else '= 0'} or edit the plan")


def parallel_request(args: argparse.Namespace, cfg: RunConfig, plan: str | None,
                     nproc: int | None, force: bool = False) -> ParallelRequest | None:
    """The parallel part of the command line; None when nothing asks for torch.distributed."""
    from meshtron.compress.cli import requested, search_knobs
    from meshtron.train.planning import fixed_knobs, is_plan_file

    comm = requested(args)
    if not is_plan_file(plan):  # a saved plan states its own (checked against the checkpoint)
        from meshtron.train.resume_args import resumed_comm

        comm = {**resumed_comm(args, cfg), **comm}
    offload = getattr(args, "offload", None)
    offload_act = getattr(args, "offload_activations", False)
    async_tp = getattr(args, "async_tp", False)
    flags = (plan, args.cluster, args.zero, args.schedule, args.recompute, args.sp, offload)
    if all(f is None for f in flags) and not comm and (nproc or 1) == 1 and not offload_act \
            and not async_tp \
            and not args.launched_rank and args.watchdog_timeout is None and not force:
        return None
    knobs = fixed_knobs(plan, args.zero, args.recompute, args.sp, cfg.data.micro_batch,
                        args.schedule)
    if offload is not None:
        knobs["offload"] = offload
    if offload_act:
        knobs["offload_activations"] = True
    if cfg.train.compile and not is_plan_file(plan):
        knobs["compile"] = True  # the planner prices the compiled ('fused') stack
    if async_tp:
        knobs["async_tp"] = True
    if not is_plan_file(plan):
        from meshtron.train.resume_args import resumed_knobs

        knobs = search_knobs(comm, resumed_knobs(args, cfg, knobs))
    layout_given = (any(f is not None for f in flags) or requested(args) or offload_act
                    or async_tp or getattr(args, "nnodes", None))
    return ParallelRequest(plan=plan or "auto", nproc=nproc, cluster=args.cluster, knobs=knobs,
                           comm=comm,
                           resumed_plan=None if layout_given else _resumed_plan(args, cfg))


def _resumed_plan(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any] | None:
    """The plan the checkpoint a `--resume` loads was saved with (None: not a resume, or a
    checkpoint that recorded none)."""
    from meshtron.train.resume_args import resumed_meta

    resumed = resumed_meta(args, cfg.train.run_dir)
    plan = None if resumed is None else resumed[1].get("plan")
    return plan if isinstance(plan, dict) else None


def job_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None,
                  plan: str | None = None, nproc: int | None = None,
                  overwrite: bool = False) -> TrainJob:
    """Validate the whole command line into a typed job (reads the run file and a saved plan;
    starts nothing, writes nothing). `defaults`, `plan`, `nproc`, `overwrite`: what a command
    (the demo) uses where the user gave nothing."""
    cfg = run_config(args, defaults)
    from meshtron.model.shapes import runtime_refusal

    if runtime_refusal(cfg.model):  # a planned-only model: refused before any rank starts
        raise UserError(runtime_refusal(cfg.model))
    from meshtron.hf.hooks import check_job

    check_job(cfg)
    from meshtron.train.resume_args import check_given

    resumed = check_given(args, cfg)
    ckpt = checkpoint_config(args, resumed)
    from meshtron.train.elastic import from_args as elastic_from_args
    from meshtron.train.resume_args import resumed_nproc

    elastic = elastic_from_args(args, args.nproc or nproc)
    nproc = resumed_nproc(args, resumed, nproc)
    # restarts need torchrun's elastic agent, so they run the parallel path
    request = parallel_request(args, cfg, args.plan or plan, nproc,
                               force=ckpt.max_restarts > 0 or elastic is not None)
    if not args.launched_rank and not getattr(args, "elastic_rank", None):
        from meshtron.checkpoint.config import refuse_unread  # ranks get every flag restated
        from meshtron.train.planning import requested_compression

        typed = {k: getattr(args, k) for k in ("keep", "checkpoint_residuals", "mtbf_hours",
                                                "preempt_grace")}
        refuse_unread(typed, ckpt, requested_compression(request))
    return TrainJob(cfg=cfg,
                    parallel=request,
                    elastic=elastic,
                    overwrite=args.overwrite or overwrite, launched_rank=args.launched_rank,
                    watchdog_timeout_s=args.watchdog_timeout, recorder=not args.no_recorder,
                    checkpoint=ckpt)


def cmd_train(args: argparse.Namespace) -> int:
    from meshtron.train.launch import run_job

    cfg = run_config(args)
    if args.resume and args.overwrite and not args.launched_rank:
        # both were taken as --resume, silently (session-52 user audit)
        raise UserError(f"--resume with --overwrite: allowed one of them (--resume continues "
                        f"the run in train.run_dir={cfg.train.run_dir!r}, --overwrite replaces "
                        "it with a new run)")
    if args.resume and not args.launched_rank:
        from meshtron.train.replica_run import refuse_resume

        refuse_resume(cfg.train.run_dir)  # before any other check of the folder
        _refuse_live_run(args, cfg.train.run_dir)
    if cfg.train.replica_ft:
        from meshtron.train.replica import check_replica_ft
        from meshtron.train.replica_run import run_replica_ft

        check_replica_ft(cfg, parallel_asked=parallel_request(args, cfg, args.plan,
                                                              args.nproc) is not None,
                         saving={"--checkpoint-every": args.checkpoint_every,
                                 "--snapshot-every": args.snapshot_every,
                                 "--resume": args.resume})
        return run_replica_ft(TrainJob(cfg=cfg, overwrite=args.overwrite),
                              max_restarts=max(args.max_restarts or 0, 0))
    return run_job(job_from_args(args))


def _refuse_live_run(args: argparse.Namespace, run_dir: str) -> None:
    """A --resume typed into a folder a live run holds: said first, before its settings are
    compared with the checkpoint (a `--steps` of another schedule was refused for its learning
    rate while the run still trained there: session-52 user audit). Only for the command a user
    types: a rank (of meshtron's launcher, an elastic round or an outside torchrun) runs
    beside the run's own holders of the lock."""
    from meshtron.launch import current_world
    from meshtron.train import run_lock

    if getattr(args, "elastic_rank", None) or current_world().source != "single":
        return
    run_lock.check_free(run_dir)


def cmd_demo(args: argparse.Namespace) -> int:
    """Calibrate this machine (once), plan for it, then train on local ranks."""
    from meshtron.launch import current_world
    from meshtron.train import demo
    from meshtron.train.launch import run_job

    if current_world().source != "single" or args.launched_rank:
        # A rank of the demo (or the demo inside an outside world).
        return run_job(job_from_args(args, defaults=demo.DEMO_CONFIG))
    # The demo's own folder is replaced on every run; a --run-dir of the user's is protected.
    job = job_from_args(args, defaults=demo.DEMO_CONFIG, plan=demo.DEMO_LAYOUT,
                        nproc=demo.DEMO_NPROC,
                        overwrite=args.train__run_dir is None and args.config is None)
    return demo.run_demo(job)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model (one process or many ranks)",
                       description="Train a model. Configure with --config RUN.toml and/or flags.")
    add_run_arguments(p)
    add_parallel_arguments(p)
    add_checkpoint_arguments(p)
    from meshtron.train.elastic import add_arguments as add_elastic_arguments

    add_elastic_arguments(p)
    p.set_defaults(func=cmd_train)
    d = sub.add_parser("demo", help="the main job on the embedded default (no downloads)",
                       description="Calibrate this machine, plan for it, and train the tiny model "
                                   "on 4 local ranks (layout tp=2, the "
                                   "rest chosen by the planner) on the Python standard "
                                   "library's sources.")
    add_run_arguments(d)
    add_parallel_arguments(d)
    add_checkpoint_arguments(d)
    d.set_defaults(func=cmd_demo)
