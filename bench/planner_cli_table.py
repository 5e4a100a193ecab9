"""The published table through the command line: what a user of `meshtron plan` gets.

Every row of bench/published/runs.py (plus the Megatron-LM 2021 weak-scaling rows are left to
bench/planner_published.py) is written out as files a user would write, and run as

    meshtron plan --model ROW.model.toml --cluster ROW.cluster.toml --global-batch B \\
        --seq-len S --framework NAME@ERA [--options ROW.options.toml] --layout tp=..,pp=..,dp=.. \\
        --zero Z --recompute R --sp on|off [--micro-batch M] [--schedule S] \\
        --dp-replicate N [--pipeline-runs N] --dtype bf16 --json

with the framework preset closest to the row's software (fewest differing options) and the
remaining differences in an [options] table. Every knob the run fixed (micro-batch, virtual
stages, schedule: from the source or from the software's documented default, see each row's
note) is passed; only what neither fixes (recompute 'any', micro-batch lists) is searched.
Every row pins its layout (tp, cp, pp, dp, and ep for mixtures of experts), so a row the
memory model predicts not to fit is still priced (`meshtron plan` answers a pinned layout, fits
false): it is counted as "answered, predicted not to fit", its error from the priced step like
any other. A row the planner refuses outright (exit 2) is counted as "rejected" (the goal is
none). Rows with torchtitan's selective op AC run as the torchtitan preset's `--recompute
selective`; its every-other-layer AC (sel-layer rows) as `--recompute half`.

Error = predicted / published throughput - 1 (step time: published / predicted - 1).

    python bench/planner_cli_table.py [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tomli_w  # noqa: E402

from bench.published.runs import published_runs  # noqa: E402
from meshtron.planner import memory  # noqa: E402
from meshtron.planner.frameworks import PRESETS, for_model  # noqa: E402
from meshtron.planner.plan_rules_options import option_values  # noqa: E402
from meshtron.planner.plan_rules_runtime import options_runtime_problems  # noqa: E402


def _options_for(run) -> tuple[str, dict]:
    """(closest preset, the option values that differ from it) for a row's software."""
    kern = dataclasses.asdict(run.opts)
    mem = run.row_memory
    mem_d = {k: v for k, v in dataclasses.asdict(mem).items() if k != "dtype"}
    # a row that names no stack rule for ZeRO stages or host offload runs whatever it pins:
    # 'any', written out, so that the closest preset's own rule does not refuse its layout
    mem_d.update({k: "any" for k in ("zero_stages", "host_offload") if mem_d[k] is None})
    red = "fp32" if run.opts.fp32_grad_reduce else "bf16"
    # options meshtron's runtime does not run (plan_rules_options): another stack's row, which
    # --framework meshtron refuses
    elsewhere = any(options_runtime_problems(option_values(run.opts, mem, red), {}))
    best = None
    for key, preset in PRESETS.items():
        fw = for_model(preset, run.model)  # as `meshtron plan` prices the row's model
        if run.ep > 1 and not fw.expert_parallel:  # a preset that refuses the row's ep
            continue
        if elsewhere and fw.name == "meshtron":
            continue
        diff = {k: v for k, v in kern.items() if getattr(fw.kernel, k) != v}
        fw_mem = dataclasses.asdict(fw.memory)
        # memory defaults that resolve to the same list/loss count as equal
        diff.update({k: v for k, v in mem_d.items() if fw_mem[k] != v
                     and not (k in ("activations", "loss", "layouts", "half_counts")
                              and v is None)})
        # likewise the parallelisms, where the preset refuses some (plan_rules_stack): M19's
        # Megatron-LM 2019 at tp=8 is closest to llm-foundry's options
        if mem_d["layouts"] is None and fw_mem["layouts"] is not None:
            diff["layouts"] = "any"
        if fw.reduce_dtype != red:
            diff["reduce_dtype"] = red
        rank = (len(diff), 0 if fw.name in run.stack.lower() else 1)
        if best is None or rank < best[0]:
            best = (rank, key, diff)
    return best[1], best[2]


def _recompute(run) -> str:
    """The row's recomputation as `--recompute` spells it: torchtitan's selective "op" AC is the
    torchtitan preset's 'selective'; its every-other-layer AC (selective_ac_option "2") is
    'half'."""
    if run.recompute == "half" and ("(op)" in run.note or "sel-op" in run.name):
        return "selective"
    return run.recompute


def _args(run, d: Path) -> list[str] | None:
    recompute = _recompute(run)
    model = {k: v for k, v in dataclasses.asdict(run.model).items() if v is not None}
    model["max_seq"] = max(model["max_seq"], run.seq_len)  # the row trained at that length
    (d / "model.toml").write_text(tomli_w.dumps({"model": model}))
    cl = {k: v for k, v in run.cluster.to_dict().items() if k != "name"}
    (d / "cluster.toml").write_text(tomli_w.dumps(cl))
    fw, diff = _options_for(run)
    args = ["plan", "--model", str(d / "model.toml"), "--cluster", str(d / "cluster.toml"),
            "--global-batch", str(run.global_batch), "--seq-len", str(run.seq_len),
            "--framework", fw,
            "--layout", f"tp={run.tp},cp={run.cp},pp={run.pp},dp={run.dp}"
                        # a mixture of experts' ep is open unless given where dp x cp > 1
                        # (pinned.layout_pinned: one layout left to the search)
                        + (f",ep={run.ep}" if run.ep > 1 or run.model.is_moe else "")
                        + (f",etp={run.etp}" if run.etp is not None else ""),
            "--zero", str(run.zero),
            "--sp", "on" if run.sp else "off", "--dtype", run.dtype, "--json", "--top", "1",
            "--offload", "none"]  # no published row offloads to the host
    if recompute != "any":  # 'any': the source does not say; the search picks what fits
        args += ["--recompute", recompute]
    if diff:
        clean = {k: v for k, v in diff.items() if v is not None}
        (d / "options.toml").write_text(tomli_w.dumps({"options": clean}))
        args += ["--options", str(d / "options.toml")]
    if len(run.micro_batches) == 1:
        args += ["--micro-batch", str(run.micro_batches[0])]
    if run.pp > 1 and len(run.schedules) == 1:
        sched = run.schedules[0]
        if sched == "interleaved" and run.virtual_stages:
            sched = f"interleaved:{run.virtual_stages}"
        args += ["--schedule", sched]
    # the run's replicas, 1 included: a row without HSDP ran plain FSDP, which the search
    # (SearchSpace.replicates) would otherwise be free to replace by node-aligned replicas
    args += ["--dp-replicate", str(run.dp_replicate)]
    if run.pipeline_runs > 1:
        args += ["--pipeline-runs", str(run.pipeline_runs)]
    return args


def _value(run, plan: dict) -> float:
    gpus = run.gpus
    return {"step_s": plan["step_time_s"], "tokens_per_gpu": plan["tokens_per_s"] / gpus,
            "model_tflops": plan["model_tflops_per_gpu"], "mfu": plan["mfu"],
            "hw_tflops": plan["hardware_tflops_per_gpu"]}[run.metric]


def run_row(run) -> dict:
    import meshtron.cli as top

    with tempfile.TemporaryDirectory() as tmp:
        args = _args(run, Path(tmp))
        if args is None:
            return {"run": run, "status": "not expressible"}
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = top.main(args)
    doc = json.loads(out.getvalue()) if out.getvalue().strip() else {}
    if rc != 0 or not doc.get("plans"):  # refused outright: "rejected"
        nm = doc.get("near_miss") or {}
        need = nm.get("memory_gib", {}).get("total")
        return {"run": run, "status": "rejected", "need": need,
                "error": err.getvalue().strip()[-160:]}
    plan = doc["plans"][0]
    value = _value(run, plan)
    error = (run.published / value - 1.0) if run.metric == "step_s" else value / run.published - 1
    return {"run": run, "status": "ok" if plan["fits"] else "unfit", "value": value,
            "error": error, "args": args, "need": plan["memory_gib"]["total"],
            "memory": plan["memory_gib"]}


def summarise(rows: list[dict], part: str) -> dict:
    mine = [r for r in rows if r["run"].part == part]
    ok = [abs(r["error"]) for r in mine if r["status"] in ("ok", "unfit")]
    return {"n": len(mine), "answered": len(ok),
            "unfit": sum(r["status"] == "unfit" for r in mine),
            "rejected": sum(r["status"] == "rejected" for r in mine),
            "not_expressible": sum(r["status"] == "not expressible" for r in mine),
            "mean": sum(ok) / len(ok) if ok else float("nan"), "max": max(ok, default=float("nan"))}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the meshtron command each row runs")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    verbose = parse_args(argv).verbose
    rows = [run_row(r) for r in published_runs()]
    for r in rows:
        run = r["run"]
        if r["status"] in ("ok", "unfit"):
            line = f"{r['error']:+7.1%}  predicted {r['value']:.4g} vs {run.published:.4g}"
            if r["status"] == "unfit":
                line += f"  (predicted not to fit: needs {r['need']:.1f} GiB)"
        elif r["status"] == "rejected":
            need = f"needs {r['need']:.1f} GiB" if r.get("need") else r.get("error", "")
            line = f"REJECTED ({need})"
        else:
            line = "not expressible on the command line (recompute 'half')"
        print(f"{run.part[:3]} {run.name:32} {run.metric:14} {line}")
        if verbose and r.get("args"):
            print("      meshtron " + " ".join(a for a in r["args"] if "/tmp" not in a))
    for part in ("validation", "calibration"):
        s = summarise(rows, part)
        print(f"{part}: n={s['n']} answered {s['answered']} ({s['answered'] - s['unfit']} "
              f"fitting, {s['unfit']} predicted not to fit), refused outright (memory or a "
              f"layout rule) {s['rejected']}, not expressible {s['not_expressible']}; mean |error| "
              f"{s['mean']:.1%}, max {s['max']:.1%} (over every answered row)")
        known = [r for r in rows if r["run"].part == part and r["run"].regression]
        if known:
            s = summarise([r for r in rows if not r["run"].regression], part)
            print(f"{part} without the {len(known)} row(s) that measure a regression the "
                  f"software's maintainers fixed (PublishedRun.regression): n={s['n']}, mean "
                  f"|error| {s['mean']:.1%}, max {s['max']:.1%}")
    for r in rows:
        if r["run"].regression:
            print(f"  {r['run'].name}: {r['run'].regression}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
