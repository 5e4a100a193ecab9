"""`meshtron demo`: the default model on the embedded corpus, on 4 local ranks with a hybrid
layout (tensor parallel 2; the planner picks the rest for this machine), 4-8 minutes on a
shared 2-core machine (docs/measurements.md, "The demo"). Calibrates this machine once, shows the planner's view of it, then runs the
job like `meshtron train`."""

from __future__ import annotations

from typing import Any

from meshtron.errors import RunFailed
from meshtron.train.job import ParallelRequest, TrainJob

DEMO_CONFIG: dict[str, Any] = {
    "model": "tiny",
    "data": {"source": "stdlib", "seq_len": 256, "global_batch": 16},
    "optim": {"lr": 3e-3, "warmup_steps": 10},
    "train": {"steps": 120, "eval_every": 40, "run_dir": "runs/demo"},
}
DEMO_NPROC = 4
DEMO_LAYOUT = "tp=2"


def run_demo(job: TrainJob) -> int:
    from meshtron.train.launch import run_job

    request = job.parallel or ParallelRequest()
    ensure_calibration(request.nproc or DEMO_NPROC, request.cluster)
    show_plans(job)
    return run_job(job)


def ensure_calibration(nproc: int, cluster: str | None) -> None:
    from rich.console import Console

    from meshtron.calibrate.cli import default_cluster_path
    from meshtron.launch import launch_local

    path = default_cluster_path(nproc)
    if cluster or path.is_file():
        return
    Console().print(f"[bold]calibrate[/]: measuring {nproc} local ranks (once; saved to {path})")
    if launch_local(nproc, ["calibrate", "--nproc", str(nproc)]) != 0:
        raise RunFailed("calibration failed; see the output above")


def show_plans(job: TrainJob) -> None:
    """The planner's view of this machine: top plans of every layout, and why others lose."""
    from rich.console import Console

    from meshtron.planner import report
    from meshtron.planner.search import search_plans
    from meshtron.train.planning import local_cluster

    cfg, request = job.cfg, job.parallel or ParallelRequest()
    cluster = local_cluster(request.nproc or 1, request.cluster)
    result = search_plans(cfg.model, cluster, cfg.data.global_batch, cfg.data.seq_len,
                          {"dtype": cfg.train.dtype}, top_k=3)
    console = Console()
    if not console.is_terminal:  # logs: wide enough that the table's columns stay readable
        console = Console(width=200)
    report.render(result, tokens=cfg.train.steps * cfg.data.global_batch * cfg.data.seq_len,
                  console=console)
    line = layout_note(request, result.best)
    if line:
        console.print(line)


def layout_note(request: ParallelRequest, best) -> str:
    """Why the demo then trains another layout than the table's best: the layout it was given
    (DEMO_LAYOUT, or --plan) fixes some axes and the planner picks the rest under them."""
    fixed = {k: v for k, v in request.knobs.items() if k in ("tp", "cp", "pp", "dp", "ep")}
    if best is None or not fixed:
        return ""
    differs = {k: v for k, v in fixed.items() if getattr(best.config, k) != v}
    if not differs:
        return ""
    given = ",".join(f"{k}={v}" for k, v in fixed.items())
    return (f"The run below trains layout {given} (the demo's, to show tensor parallelism; the "
            f"planner chooses the other knobs under it), not the best plan above "
            f"({best.config.layout()}); `meshtron train --nproc {request.nproc or DEMO_NPROC} "
            f"--plan auto` trains the planner's choice.")
