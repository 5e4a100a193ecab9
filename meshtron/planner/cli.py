"""`meshtron plan`: search the hybrid-parallel plans for a model on a cluster.

    meshtron plan --model llama3-70b --cluster dgx-h100:16 --global-batch 1024 --seq-len 8192
    meshtron plan --model llama3-405b --cluster dgx-h100:2048 --global-batch 2048 --seq-len 8192 \\
        --layout tp=8,pp=16 --zero 1 --schedule interleaved:2 --json
    meshtron plan --model tiny --cluster cpu.toml --global-batch 64 --seq-len 256 --save plan.toml

Exit status: 0 with a plan; 2 for a user error or when nothing fits (one line on stderr).
A pinned layout (the knobs leave the search exactly one tp, cp, pp, dp, ep layout:
planner/pinned.py layout_pinned) is answered even when it is predicted not to fit: its leanest
candidate, priced as every candidate is, marked fits false, with a warning (exit 0; --save
refuses). A pinned layout the priced stack's layer-to-stage rule cannot split (--framework
megatron@2021 with 126 layers over pp=8) is priced on the nearest split that stack's engine
could be configured to, with a warning naming the rule and the split priced (exit 0; --save
writes it: search_space.SplitFallback, report.split_warning).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from meshtron.argtypes import (negative_values_are_values, output_file, positive_int,
                               writable_target)
from meshtron.errors import UserError

DEFAULT_TOKENS_PER_STEP = 4 * 2**20  # ~4M tokens, typical LLM pre-training batch
DEFAULT_SEQ_LEN = 4096
"""--seq-len when omitted: min(the model's max_position_embeddings, 4096). Models advertise
their longest context (Qwen2-7B: 131,072), which pre-training rarely uses: Llama 2/3 and Qwen2
pre-train at 4,096-8,192 and extend the context later."""
MAX_TOKENS = 1e16
"""--tokens above this (10,000T; Llama 3 trained on 15T) is taken for a typo."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="find the fastest hybrid-parallel plan that fits, and explain it",
        description="Search data x tensor x pipeline layouts, ZeRO stage, micro-batch, "
                    "recomputation, sequence parallelism and pipeline schedule with a memory, "
                    "compute and communication cost model.")
    negative_values_are_values(p)  # `--tokens -1T`: one line naming the flag, not argparse's
    p.add_argument("--model", required=True,
                   help="preset name, Hugging Face config.json path, or TOML file with a model key")
    p.add_argument("--cluster", required=True,
                   help="dgx-a100:N, dgx-h100:N, dgx-h200:N (N nodes of 8 GPUs), "
                        "nominal-cpu:N (N CPU ranks on one machine, each with 1/N of its memory: "
                        "what an uncalibrated CPU run plans on) or a cluster TOML")
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="sequences per step (default: about 4M tokens' worth)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help=f"tokens per sequence (default: min(max_position_embeddings, "
                        f"{DEFAULT_SEQ_LEN}), stated in the output)")
    p.add_argument("--tokens", default="1T",
                   help="training budget in tokens for days / GPU-hours, e.g. 15T, 300B, 2e12")
    p.add_argument("--top", type=positive_int, default=5, help="plans to show (default 5)")
    p.add_argument("--layout", help="fix any of tp, cp, pp, dp, dp_replicate, ep, etp: e.g. "
                                    "tp=8,cp=2,pp=16,dp=64 or tp=1,pp=16,dp=128,ep=64 (ep "
                                    "folds over dp x cp); etp (megatron@2024 and "
                                    "megatron-bridge: Megatron-Core's expert tensor "
                                    "parallelism) folds ep over tp x cp x dp, ep*etp "
                                    "dividing them, e.g. "
                                    "tp=2,pp=8,dp=16,ep=32,etp=1; dp_replicate as "
                                    "--dp-replicate (dp=8,dp_replicate=2: HSDP); "
                                    "when the knobs leave one layout (axes not given count as "
                                    "fixed where the GPU count allows one value) it is pinned: "
                                    "priced even when predicted not to fit")
    p.add_argument("--zero", type=int, help="fix the ZeRO stage (0-3; only those the "
                   "--framework's stack runs: plan_rules_zero.py)")
    p.add_argument("--dp-replicate", type=positive_int, default=None,
                   help="HSDP: replicate ZeRO-2/3 shards over this many groups (divides dp)")
    p.add_argument("--pipeline-runs", type=positive_int, default=None, metavar="N",
                   help="pipeline schedule calls per optimizer step, m/N micro-batches each "
                        "(torchtitan's and nemo-automodel's gradient accumulation around "
                        "schedule.step; default 1: one schedule of all micro-batches, as "
                        "Megatron, DeepSpeed and meshtron's runtime run)")
    p.add_argument("--recompute", help="fix recomputation: none | selective | half (every second block) | full")
    p.add_argument("--sp", help="fix sequence parallelism: on | off")
    p.add_argument("--micro-batch", type=positive_int, help="fix the micro-batch size (sequences)")
    p.add_argument("--schedule",
                   help="fix the pipeline schedule: 1f1b | interleaved[:V] | zb | zbv | gpipe[:V] "
                        "| dualpipe | dualpipev (DeepSeek's engine only: an --options file "
                        "with pipeline_split = \"dualpipe\" and a stack other than meshtron's, "
                        "e.g. framework = \"megatron@2024\"; meshtron's runtime refuses it)")
    add_framework_args(p)
    p.add_argument("--dtype", default=None,
                   help="precision of the run: bf16 (default: mixed precision) | fp32 (TF32 "
                        "matmuls on CUDA) | fp8 (FP8 block GEMMs, torchao float8)")
    p.add_argument("--reduce-dtype", default=None,
                   help="gradient reduction dtype: fp32 | bf16 (default: the framework's)")
    p.add_argument("--accumulate-unsharded", action="store_true", default=None,
                   help="ZeRO-2/3: accumulate gradients unsharded, reduce-scatter once per step")
    p.add_argument("--offload", default=None,
                   help="fix host offload: none | optimizer | full (default: searched, kept "
                        "when nothing fits without it or it is faster)")
    from meshtron.planner.comm_flags import add_arguments as add_comm_arguments

    # the flags of the compression note, parsed as `meshtron train` parses them
    add_comm_arguments(p.add_argument_group("less communication (as meshtron train)"))
    p.add_argument("--wide", action="store_true",
                   help="wide table: time and memory breakdown per plan, HFU, GPU-hours")
    p.add_argument("--json", action="store_true", help="print JSON (schema in planner/report.py)")
    p.add_argument("--save", metavar="PLAN.toml", type=output_file,
                   help="write the best plan for `meshtron train`")
    p.add_argument("--rehearse", action="store_true",
                   help="also run one rank of the best plan alone (`meshtron rehearse`: fake "
                        "process group; fake tensors on CPU, real ones on a GPU) and print "
                        "its peak memory next to the planner's")
    p.set_defaults(func=run)


def add_framework_args(p: argparse.ArgumentParser) -> None:
    """--framework, --options and the single-option flags (shared by plan, cost, simulate)."""
    p.add_argument("--framework", default=None, metavar="NAME[@ERA]",
                   help="software stack to price: meshtron (default: meshtron's runtime), "
                        "torchtitan (@2024, @2025), megatron (@2021 PTD-P, @2024 "
                        "Megatron-Core/NeMo), megatron-bridge (@2025), nemo-automodel (@2025), "
                        "deepspeed (@2021 = megatron-deepspeed, @2024), gpt-neox (@2022), "
                        "llm-foundry (@2023, @2024); NAME alone is its newest era; see "
                        "meshtron/planner/frameworks.py")
    p.add_argument("--options", default=None, metavar="FILE.toml",
                   help="TOML file with an [options] table overriding single options of the "
                        "framework (and optionally framework = \"NAME@ERA\")")
    p.add_argument("--attention", default=None,
                   help="override the attention kernel: flash | unfused")
    p.add_argument("--dropout", action="store_true", default=None,
                   help="model dropout kernels (GPT-2/3-era training; modern LLMs use none)")
    p.add_argument("--stack", default=None,
                   help="override the kernels: eager (plain PyTorch) | fused (Megatron/"
                        "Transformer Engine; needs --framework a stack that has them) | "
                        "compiled (per-block torch.compile, as --compile)")


def framework_of(args: argparse.Namespace, model=None):
    """The Framework the flags ask for (frameworks.resolve), as it runs `model` when given
    (frameworks.for_model: a stack's own MoE path)."""
    from meshtron.planner.frameworks import for_model, resolve

    fw = resolve(getattr(args, "framework", None), getattr(args, "options", None),
                 stack=getattr(args, "stack", None), attention=getattr(args, "attention", None),
                 dropout=getattr(args, "dropout", None))
    return fw if model is None else for_model(fw, model)


def plan_framework(args: argparse.Namespace, plan: Any, model=None):
    """(Framework, note or None): the stack a saved plan is priced as by `cost`, `simulate
    --step` and `rehearse --plan`: the one it was saved with (Plan.framework and its
    options: what `meshtron plan` priced), an --options table and --stack / --attention /
    --dropout applied on top, as torchtitan's command line overrides its config
    (torchtitan/config/manager.py ConfigManager: "CLI args > config" precedence) and
    Megatron-Bridge's command-line overrides change a recipe's. A --framework (or an --options file's `framework`)
    naming another stack prices that stack's preset instead, without the plan's options, and
    `note` says so in one line (the caller names the file)."""
    from meshtron.planner.frameworks import (for_model, for_plan, load_options, preset,
                                             same_preset, with_flags, with_options)

    saved = for_plan(plan)
    file_fw, table = (load_options(args.options) if getattr(args, "options", None)
                      else (None, {}))
    named = getattr(args, "framework", None) or file_fw
    if named is not None and not same_preset(preset(named), saved):
        fw = framework_of(args)
        asked = "--options file's framework" if file_fw and not args.framework else "--framework"
        note = (f"saved priced for {saved.label}; priced here as {fw.label} ({asked}), "
                "without the plan's options")
        return (fw if model is None else for_model(fw, model)), note
    if named is not None and getattr(args, "framework", None) and file_fw:
        framework_of(args)  # a --framework contradicting the --options file: its one line
    fw = with_options(saved, table) if table else saved
    flags = {k: getattr(args, k, None) for k in ("stack", "attention", "dropout")}
    fw = with_flags(fw, {k: v for k, v in flags.items() if v is not None})
    return (fw if model is None else for_model(fw, model)), None


def saved_plan(args: argparse.Namespace, result: Any, gpus: int, batch: int, seq: int):
    """The best plan as `--save` writes it (and `--rehearse` runs it): its layout, what it was
    made for, its prediction, and the stack and options it was priced with
    (frameworks.saved_fields), so that `cost`, `simulate` and `rehearse` price the same."""
    from meshtron.planner.frameworks import saved_fields

    plan = result.best.to_plan(saved_path(args.model, model=True), saved_path(args.cluster),
                               gpus, batch, seq, result.options.attention)
    return plan.replace(**saved_fields(result.framework)) if result.framework else plan


def saved_path(text: str, model: bool = False) -> str:
    """A --model / --cluster value as a saved plan records it: a file or folder absolute, since
    `train`, `cost`, `simulate` and `rehearse --plan` read the plan from other folders (a path
    relative to where `plan --save` ran was 'file does not exist' there); a preset as typed
    (a model preset before a file of its name, as resolve_model reads it)."""
    from meshtron.model.spec import PRESETS

    if not text.strip() or (model and text in PRESETS) or not Path(text).exists():
        return text
    return str(Path(text).resolve())


def parse_tokens(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise UserError(f"tokens={text!r}: expected a number like 2e12, 300B or 15T")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    value = float(m.group(1)) * scale
    if value <= 0:
        raise UserError(f"tokens={text!r}: must be positive")
    if value > MAX_TOKENS:
        raise UserError(f"tokens={text!r}: more than {MAX_TOKENS:.0e} tokens "
                         "(the largest published runs train on ~15T)")
    return value


def _context_words(model) -> str:
    """The model's context length and where it comes from: max_position_embeddings, or the
    RoPE scaling's original length x factor, which exceeds it (hf_config._hf_rope: a config
    of 2048 positions with factor 2 trains at 4096, which the note had called its
    max_position_embeddings)."""
    original = model.rope_original_max_seq
    if original and model.max_seq == int(model.rope_factor * original) != original:
        return f"{model.max_seq}: {original} x its RoPE factor {model.rope_factor:g}"
    return f"max_position_embeddings {model.max_seq}"


def load_model(text: str):
    from meshtron.model.spec import resolve_model

    if text.endswith(".toml"):
        from meshtron.config import (  # the foundation's TOML model form
            load_toml,
            model_from_value,
        )

        doc = load_toml(text, field="model")
        if "model" not in doc:
            raise UserError(f"model={text!r}: the TOML file has no 'model' key or [model] table")
        return model_from_value(doc["model"])
    return resolve_model(text)


def collect_knobs(args: argparse.Namespace) -> dict[str, Any]:
    from meshtron.planner.plan import fixed_knobs

    knobs = fixed_knobs(args.layout, args.zero, args.recompute, args.sp, args.micro_batch,
                        args.schedule, args.dtype)
    replicate = getattr(args, "dp_replicate", None)
    if replicate is not None:
        if knobs.get("dp_replicate", replicate) != replicate:
            raise UserError(f"--dp-replicate={replicate}: the layout gives dp_replicate="
                            f"{knobs['dp_replicate']}; give it once")
        knobs["dp_replicate"] = replicate
    if getattr(args, "pipeline_runs", None) is not None:
        knobs["pipeline_runs"] = args.pipeline_runs
    if getattr(args, "reduce_dtype", None) is not None:
        knobs["reduce_dtype"] = args.reduce_dtype.strip().lower()
    if getattr(args, "accumulate_unsharded", None):
        knobs["accumulate_unsharded"] = True
    if getattr(args, "offload", None) is not None:
        knobs["offload"] = args.offload.strip().lower()
    return knobs


MOE_NOTE = ("mixture of experts: memory counts every expert (E/ep per rank under expert "
            "parallelism), compute the active ones as grouped GEMMs of the per-expert rows, "
            "routing imbalance {imb:g} (max/mean rank load; framework option "
            "expert_imbalance), expert all-to-alls by where the ep group sits "
            "(planner/moe_cost.py); the experts under tensor parallelism as the stack runs "
            "them (meshtron: replicated over tp; Megatron-Core: split over etp, tp unless "
            "--layout gives etp, which folds ep over tp x cp x dp)")


def long_sequence_note(model, seq: int) -> str:
    """A sequence beyond the model's trained positions is priced, with a warning: the user may
    extend the context (torchtitan trained Llama 3.1 8B at 262,144 tokens, twice its
    131,072 positions); the cost of a step does not depend on what the positions mean."""
    what = ("its learned position table has no rows for it: the run needs a longer table"
            if model.position == "learned" else "training it needs context extension "
            "(RoPE scaling) for the quality, not for the cost priced here")
    return (f"warning: seq-len {seq} exceeds the model's max_seq={model.max_seq} (its "
            f"config.json max_position_embeddings); {what}")


def run(args: argparse.Namespace) -> int:
    from meshtron.planner import report
    from meshtron.planner.cluster import resolve_cluster
    from meshtron.planner.pinned import answer_pinned
    from meshtron.planner.search import search_plans

    if args.save:  # before the search: an unwritable path is one line, nothing computed
        writable_target(args.save, "save")
    model = load_model(args.model)
    cluster = resolve_cluster(args.cluster)
    tokens = parse_tokens(args.tokens)
    notes = [note for note in [cluster.noise_note()] if note]  # a noisy calibration
    fw = framework_of(args, model)
    if model.is_moe:
        notes.append(MOE_NOTE.format(imb=fw.kernel.expert_imbalance))
    seq = args.seq_len
    if seq is None:
        seq = min(model.max_seq, DEFAULT_SEQ_LEN)
        notes.append(f"--seq-len not given: planning at {seq} tokens per sequence, the smaller "
                     f"of the model's context ({_context_words(model)}) and {DEFAULT_SEQ_LEN}")
    refused = model_refusal(model)
    if refused:  # priced as the stack would run it; said here, not first at `meshtron train`
        notes.append(f"meshtron train refuses this model: {refused}")
    # what `meshtron train` will warn of the config.json (its dropout: hf_config.dropout_notes)
    notes.extend(f"meshtron train warns: {note}" for note in model.train_notes)
    if seq > model.max_seq:
        notes.append(long_sequence_note(model, seq))
    batch = args.global_batch
    if batch is None:
        batch = 1 << max(0, (DEFAULT_TOKENS_PER_STEP // seq).bit_length() - 1)
        notes.append(f"--global-batch not given: planning at {batch} sequences per step "
                     f"(about {DEFAULT_TOKENS_PER_STEP // 2**20}M tokens)")
    from meshtron.planner.comm_flags import refuse_unread, requested, search_knobs

    comm = requested(args)  # priced on every searched layout (search.py `_priced`)
    refuse_unread(comm)
    knobs = {**search_knobs(comm, collect_knobs(args)), **comm}
    # a pinned layout (one layout left to the search) is priced even when predicted not to fit
    result = answer_pinned(search_plans(model, cluster, batch, seq, knobs, top_k=args.top,
                                        framework=fw), knobs, fw)
    result.notes[:0] = notes
    from meshtron.planner.compression_advice import advice

    from meshtron.planner.host_advice import launch_note

    line = advice(result)  # compression / DiLoCo when the best plan is inter-node bound
    if line:
        result.notes.append(line)
    line = launch_note(result)  # when the GPU waits on the host's kernel launches
    if line:
        result.notes.append(line)
    from meshtron.planner.fp8_advice import fp8_note

    line = fp8_note(result, knobs, fw)  # FP8 priced slower than bf16 on the eager stack
    if line:
        result.notes.append(line)
    width = None if sys.stdout.isatty() else (220 if args.wide else 100)
    try:
        return _output(args, result, tokens, width, cluster.num_gpus, batch, seq)
    except BrokenPipeError:
        quiet_broken_pipe()
        return 0


def _rehearse(args: argparse.Namespace, result: Any, gpus: int, batch: int, seq: int):
    """`meshtron rehearse` of the best plan (None when nothing fits). The rehearsal runs the
    runtime, a layer above the planner: `meshtron.cli` hands its entry points in as
    `args.rehearsal` (run, print) rather than the planner importing them. A pinned layout
    predicted not to fit is rehearsed too: the rehearsal is what checks that prediction."""
    if not result.plans:
        return None
    plan = saved_plan(args, result, gpus, batch, seq)
    return args.rehearsal[0](load_model(args.model), plan, args.cluster)


def _runtime_refusal(plan: Any, model: Any) -> str | None:
    """The line meshtron's runtime would refuse a saved plan with (Plan.validate: the one
    validity function, runtime limits included; then the model's own, `model_refusal`), or
    None when `meshtron train` runs it."""
    try:
        plan.validate(plan.gpus)
    except UserError as e:
        return str(e)
    return model_refusal(model)


def model_refusal(model: Any) -> str | None:
    """What `meshtron train` refuses of the model itself, whatever the layout and mask (the
    checks job_from_args runs: planned-only features, shapes.runtime_refusal; soft-capping,
    hf_variants.runtime_problem), or None."""
    from meshtron.model.hf_variants import runtime_problem
    from meshtron.model.shapes import runtime_refusal

    return runtime_refusal(model) or runtime_problem(model)


def quiet_broken_pipe() -> None:
    """The reader of stdout went away (`meshtron plan --json | head -1`): point stdout at
    /dev/null so that the interpreter's final flush cannot raise again, and say nothing."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _output(args: argparse.Namespace, result: Any, tokens: float, width: int | None,
            gpus: int, batch: int, seq: int) -> int:
    from meshtron.planner import report

    console = None
    if args.save and result.pinned:  # before any output: one line, nothing written
        change = result.fit_change
        raise UserError(
            f"save={args.save!r}: not saved, the plan is predicted not to fit "
            f"({report.need_text(result.best, parts=False)}); "
            + (f"fix the change that fits ({change.label}) or drop --save" if change else
               "no value of the fixed knobs fits this layout: change the layout or drop "
               "--save"))
    rehearsal = (_rehearse(args, result, gpus, batch, seq) if getattr(args, "rehearse", False)
                 else None)
    if args.json:
        doc = report.to_json(result, tokens)
        if rehearsal is not None:
            doc["rehearsal"] = rehearsal
        print(json.dumps(doc, indent=2), flush=True)
    else:
        from rich.console import Console  # only tables need rich (~0.1 s of imports)

        console = Console(stderr=False, width=width)
        report.render(result, tokens, console, wide=args.wide)
        if rehearsal is not None:
            args.rehearsal[1](rehearsal)
    if args.json:  # the text printed them; JSON carries them and repeats them on stderr
        for line in report.warnings(result):
            print(f"warning: {line}", file=sys.stderr, flush=True)
    if result.pinned:  # priced although predicted not to fit
        return 0
    if not result.fits:
        from rich.console import Console

        # the paragraph goes to stdout with the table (stderr with --json); the one-line error
        # (printed by the CLI's error handler) to stderr: each once
        line = report.render_no_fit(result, console if not args.json else
                                    Console(file=sys.stderr, width=width))
        raise UserError(line)
    if args.save:
        plan = saved_plan(args, result, gpus, batch, seq)
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)  # writable_target vetted it
        plan.save(args.save)
        if console is not None:
            # a plan priced for another stack's engine (DeepSeek's DualPipe) is saved for the
            # record, but the one validity function says meshtron's runtime will refuse it
            refused = _runtime_refusal(plan, result.model)
            stack = (f"; `meshtron cost`, `simulate --step` and `rehearse --plan` price it "
                     f"as {result.framework.label} again" if plan.framework else "")
            if refused is None:
                console.print(f"Saved the best plan to {args.save} (dtype {plan.dtype}: "
                              f"`meshtron train --plan {args.save}` trains in it; --dtype here "
                              f"changes it{stack})")
            else:  # the plan, not its dtype, is what the runtime refuses
                console.print(f"Saved the best plan to {args.save} (dtype {plan.dtype}{stack});"
                              f" `meshtron train` will refuse this plan: {refused}")
    return 0
