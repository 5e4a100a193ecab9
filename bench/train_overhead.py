"""Step-time overhead of the meshtron trainer vs a hand-written plain PyTorch loop.

Same layout, same model class (`meshtron.model.Transformer`), same seed, same batches, same
optimizer settings, in the SAME torchrun launch and process group, interleaved in alternating
rounds (A B / B A / A B ...) so that machine noise (other jobs on a shared 2-core box) hits both
sides alike:

  A  meshtron: `ParallelEngine` (build_mesh + parallelize + build_optimizer) driven by
     `run_loop`, i.e. exactly what `meshtron train --plan ...` runs on each rank. Step time is
     what run_loop records (`step_time_s` of metrics.jsonl): data fetch + train step, the
     slowest rank's value.
  B  hand-written: init_device_mesh, parallelize_module (ColwiseParallel / RowwiseParallel,
     loss_parallel), fully_shard per block + root, torch.optim.AdamW (fused, same decay
     groups), LambdaLR, torch.nn.utils.clip_grad_norm_ (foreach); no meshtron.parallel code.
     Timed the same way (data fetch + step, max over ranks).

Printed: per pair of rounds the ratio A/B of the median step times; the median ratio and its
spread (quartiles); the ratio of the fastest steps; the A/B ratio of CPU seconds spent in the
train step summed over ranks (process CPU time, gloo threads included: barely affected by other
jobs on the machine, so it isolates framework overhead); also the ratio of whole-round wall
times (A's includes run_loop's per-call set-up: metrics file, eval-set materialisation).
Losses of A and B are compared step by step as a check that both sides compute the same thing.

    .venv/bin/python bench/train_overhead.py                      # both default layouts
    .venv/bin/python bench/train_overhead.py --layouts dp=2 --pairs 4 --steps-per-round 3

Layouts: 'dp=2' on 2 ranks (zero 3) and 'tp=2,dp=2' on 4 ranks (zero 3) by default. Only
pp=1 layouts with zero 2 or 3 (FSDP2) are supported by the hand-written side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_LAYOUTS = ["dp=2", "tp=2,dp=2"]


def _parse_layout(text: str) -> dict[str, int]:
    out = {"tp": 1, "pp": 1, "dp": 1}
    for part in text.split(","):
        k, v = part.split("=")
        out[k.strip()] = int(v)
    return out


# ----------------------------------------------------------------------------------------------
# Parent: one torchrun launch per layout
# ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=";".join(DEFAULT_LAYOUTS),
                    help="';'-separated layouts, e.g. 'dp=2;tp=2,dp=2' (pp must be 1)")
    ap.add_argument("--zero", type=int, default=3, choices=[2, 3])
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per micro-batch (default: the planner's choice)")
    ap.add_argument("--pairs", type=int, default=16, help="measured (A,B) round pairs")
    ap.add_argument("--steps-per-round", type=int, default=1,
                    help="steps per round (1: alternate every step, best against load drift)")
    ap.add_argument("--warmup-steps", type=int, default=2,
                    help="untimed steps of each side before the first round")
    ap.add_argument("--progress", action="store_true",
                    help="show run_loop's progress bar on rank 0 (outside the timed step)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    results = []
    for text in [t for t in args.layouts.split(";") if t.strip()]:
        lay = _parse_layout(text)
        if lay["pp"] != 1:
            raise SystemExit(f"layout {text}: pp must be 1 (the hand-written side has no pipeline)")
        n = lay["tp"] * lay["pp"] * lay["dp"]
        tag = text.replace(",", "_").replace("=", "")
        out_json = ROOT / "runs" / "bench" / "train_overhead" / f"{tag}.json"
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={n}", str(Path(__file__).resolve()), "--worker",
               "--layout", text, "--zero", str(args.zero), "--pairs", str(args.pairs),
               "--steps-per-round", str(args.steps_per_round),
               "--warmup-steps", str(args.warmup_steps), "--seq-len", str(args.seq_len),
               "--global-batch", str(args.global_batch)] + (["--progress"] if args.progress else [])
        if args.micro_batch:
            cmd += ["--micro-batch", str(args.micro_batch)]
        env = dict(os.environ, OMP_NUM_THREADS="1", TRAIN_OVERHEAD_OUT=str(out_json))
        print(f"\n=== layout {text} on {n} ranks (zero {args.zero}) ===", flush=True)
        t0 = time.perf_counter()
        code = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        if code != 0 or not out_json.is_file():
            print(f"layout {text}: launch failed (exit code {code})")
            continue
        res = json.loads(out_json.read_text())
        res["launch_s"] = time.perf_counter() - t0
        results.append(res)

    if results:
        print("\n=== summary: meshtron / hand-written step time (goal <= 1.03) ===")
        print("ratio = median over pairs of A/B (A: meshtron, B: hand-written); q1..q3 its "
              "quartiles; best = fastest A step / fastest B step; wall = whole rounds; "
              "cpu = median over pairs of A/B CPU seconds of train_step summed over ranks")
        print(f"{'layout':<12} {'ranks':>5} {'plan':<30} {'A med s':>8} {'B med s':>8} "
              f"{'ratio':>6} {'q1..q3':>13} {'best':>6} {'wall':>6} {'cpu':>6} {'cpu q1..q3':>13} "
              f"{'|dloss|':>8}")
        for r in results:
            print(f"{r['layout']:<12} {r['ranks']:>5} {r['plan']:<30} {r['a_median_s']:>8.3f} "
                  f"{r['b_median_s']:>8.3f} {r['ratio_median']:>6.3f} "
                  f"{r['ratio_q1']:>6.3f}..{r['ratio_q3']:<6.3f} {r['best_ratio']:>6.3f} "
                  f"{r['wall_ratio_median']:>6.3f} {r['cpu_ratio']:>6.3f} "
                  f"{r['cpu_q1']:>6.3f}..{r['cpu_q3']:<6.3f} {r['max_abs_dloss']:>8.1e}")
    return 0


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ----------------------------------------------------------------------------------------------
# Worker (every rank)
# ----------------------------------------------------------------------------------------------
def _demo_cfg(args, steps: int, run_dir: str):
    from meshtron.config import apply_overrides, config_from_dict
    from meshtron.train.demo import DEMO_CONFIG

    doc = json.loads(json.dumps(DEMO_CONFIG))
    return config_from_dict(apply_overrides(doc, {
        "data.seq_len": args.seq_len, "data.global_batch": args.global_batch,
        "train.steps": steps, "train.eval_every": 0, "train.run_dir": run_dir}))


class HandWritten:
    """Plain PyTorch: the textbook FSDP2 (+ TP) recipe for meshtron.model.Transformer."""

    def __init__(self, cfg, tp: int, dp: int, zero: int, micro_batch: int):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Replicate, Shard, distribute_module
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        from meshtron.model import Transformer
        from meshtron.train.optim import lr_factor  # warm-up + cosine arithmetic only

        self.tp, self.dp, self.micro = tp, dp, micro_batch
        self.mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(cfg.train.seed)
        model = Transformer(cfg.model)
        if tp > 1:
            tp_mesh = self.mesh["tp"]
            parallelize_module(model, tp_mesh, {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            })
            for block in model.layers.values():
                parallelize_module(block, tp_mesh, {
                    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                    "feed_forward.w2": RowwiseParallel(),
                })
            # Norm weights: replicated DTensors on the tp mesh, so that every parameter is a
            # DTensor on the same mesh (FSDP2 then shards all of them 2-D; clip_grad_norm_ can
            # stack their norms).
            for mod in model.modules():
                own = list(mod.named_parameters(recurse=False))
                if own and not any(isinstance(p, torch.distributed.tensor.DTensor) for _, p in own):
                    distribute_module(
                        mod, tp_mesh,
                        input_fn=lambda m, inp, mesh: tuple(
                            torch.distributed.tensor.DTensor.from_local(x, mesh, [Replicate()],
                                                                        run_check=False)
                            if isinstance(x, torch.Tensor)
                            and not isinstance(x, torch.distributed.tensor.DTensor) else x
                            for x in inp),
                        output_fn=lambda m, out, mesh: out.to_local()
                        if isinstance(out, torch.distributed.tensor.DTensor) else out)
        if dp > 1:
            reshard = zero == 3
            for block in model.layers.values():
                fully_shard(block, mesh=self.mesh["dp"], reshard_after_forward=reshard)
            fully_shard(model, mesh=self.mesh["dp"], reshard_after_forward=reshard)
        self.model = model
        o = cfg.optim
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
        steps = cfg.train.steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, steps, o.warmup_steps, o.min_lr_ratio))
        self.grad_clip = o.grad_clip

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def train_step(self, inputs, targets):
        import contextlib

        import torch
        import torch.nn.functional as F

        n_micro = inputs.shape[0] // self.micro
        ctx = contextlib.nullcontext()
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            ctx = loss_parallel()
        total = torch.zeros(())
        with ctx:
            for x, y in zip(inputs.chunk(n_micro), targets.chunk(n_micro)):
                logits = self.model(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                (loss / n_micro).backward()
                loss = loss.detach()
                total += loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / n_micro  # this dp rank's mean loss (a tensor: no host sync here)


class _CpuTimed:
    """Delegates to the engine; records this process's CPU seconds (all threads, incl. gloo's)
    spent inside each train_step. CPU time hardly depends on how busy the shared machine is,
    so it shows framework overhead that wall time buries in noise."""

    def __init__(self, engine):
        self._engine = engine
        self.cpu: list[float] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def train_step(self, inputs, targets):
        c0 = time.process_time()
        out = self._engine.train_step(inputs, targets)
        self.cpu.append(time.process_time() - c0)
        return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from meshtron.launch import current_world
    from meshtron.planner.plan import fixed_knobs
    from meshtron.runtime import init_rank, shutdown_rank
    from meshtron.train.loop import build_run_data, run_loop
    from meshtron.train.parallel import ParallelEngine
    from meshtron.train.job import ParallelRequest
    from meshtron.train.planning import resolve_run_plan

    world = current_world()
    device = init_rank(world)
    rank0 = world.rank == 0
    lay = _parse_layout(args.layout)
    k = args.steps_per_round
    total_steps = args.warmup_steps + args.pairs * k
    run_dir = str(ROOT / "runs" / "bench" / "train_overhead" / "run")
    cfg = _demo_cfg(args, total_steps, run_dir)

    knobs = fixed_knobs(args.layout, args.zero, "none", "off", args.micro_batch, None)
    plan, _ = resolve_run_plan(cfg, ParallelRequest(plan=args.layout, knobs=knobs),
                               world.world_size)
    plan_text = f"zero={plan.zero} mb={plan.micro_batch} rc={plan.recompute} sp={int(plan.sp)}"
    if rank0:
        print(f"plan: {plan.layout()} {plan_text}; {args.pairs} pairs x {k} steps, "
              f"{args.warmup_steps} warm-up steps each side", flush=True)

    # A: meshtron, exactly as train_on_rank builds it.
    eng = ParallelEngine(cfg, plan, device)
    timed = _CpuTimed(eng)
    data_a = build_run_data(cfg, dp_rank=eng.dp_rank, dp_size=plan.dp)
    # B: hand-written.
    hand = HandWritten(cfg, lay["tp"], lay["dp"], plan.zero, plan.micro_batch)
    data_b = build_run_data(cfg, dp_rank=hand.dp_rank, dp_size=lay["dp"])

    round_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=k))
    warm_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                  steps=args.warmup_steps))
    losses_a: list[float] = []
    losses_b: list[torch.Tensor] = []
    cpu_b: list[float] = []

    def round_a(c) -> tuple[list[float], float]:
        dist.barrier()
        t0 = time.perf_counter()
        result = run_loop(timed, data_a, c, Path(run_dir), show_progress=rank0 and args.progress)
        wall = time.perf_counter() - t0
        # run_loop keeps only first/final loss; read every step's loss from its metrics file.
        if rank0:
            lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
            losses_a.extend(json.loads(l)["loss"] for l in lines)
        # Every step's time (the slowest rank's), from the records rank 0 keeps.
        return [r["step_time_s"] for r in result.records], wall

    def round_b(steps: int) -> tuple[list[float], float]:
        dist.barrier()
        out = []
        t_round = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            inputs, targets = data_b.next_batch()
            c0 = time.process_time()
            losses_b.append(hand.train_step(inputs, targets))
            cpu_b.append(time.process_time() - c0)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # as run_loop's engine.read_log()
            out.append(float(t.item()))
        return out, time.perf_counter() - t_round

    # Warm-up (untimed): lazy initialisation, FSDP2 first-iteration set-up, allocator.
    round_a(warm_cfg)
    round_b(args.warmup_steps)
    pairs = []
    for i in range(args.pairs):
        if i % 2 == 0:
            ta, wa = round_a(round_cfg)
            tb, wb = round_b(k)
        else:
            tb, wb = round_b(k)
            ta, wa = round_a(round_cfg)
        pairs.append((ta, tb, wa, wb))
        if rank0:
            print(f"pair {i}: A {statistics.median(ta):.3f} s  B {statistics.median(tb):.3f} s  "
                  f"ratio {statistics.median(ta) / statistics.median(tb):.3f}  "
                  f"(wall {wa:.2f} / {wb:.2f} s)", flush=True)

    # Same computation? B's per-rank losses -> global mean, compared with A's logged losses.
    lb = torch.stack([l.reshape(()) for l in losses_b])
    dist.all_reduce(lb, group=hand.mesh["dp"].get_group())
    lb = (lb / lay["dp"]).tolist()
    # CPU seconds per step, summed over ranks (timed steps only: drop the warm-up).
    w = args.warmup_steps
    cpu = torch.tensor([timed.cpu[w:], cpu_b[w:]], dtype=torch.float64)
    dist.all_reduce(cpu)
    cpu_a_steps, cpu_b_steps = cpu[0].tolist(), cpu[1].tolist()

    if rank0:
        ratios = [statistics.median(a) / statistics.median(b) for a, b, _, _ in pairs]
        walls = [wa / wb for _, _, wa, wb in pairs]
        all_a = [t for a, _, _, _ in pairs for t in a]
        all_b = [t for _, b, _, _ in pairs for t in b]
        cpu_ratios = [statistics.median(cpu_a_steps[i * k:(i + 1) * k])
                      / statistics.median(cpu_b_steps[i * k:(i + 1) * k])
                      for i in range(len(pairs))]
        dloss = max(abs(x - y) for x, y in zip(losses_a, lb))
        res = {"layout": args.layout, "ranks": world.world_size, "plan": plan_text,
               "a_median_s": statistics.median(all_a), "b_median_s": statistics.median(all_b),
               "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
               "ratio_max": max(ratios), "ratios": ratios,
               "pooled_ratio": statistics.median(all_a) / statistics.median(all_b),
               "ratio_q1": _quantile(ratios, 0.25), "ratio_q3": _quantile(ratios, 0.75),
               "best_ratio": min(all_a) / min(all_b),
               "cpu_a_s": statistics.median(cpu_a_steps), "cpu_b_s": statistics.median(cpu_b_steps),
               "cpu_ratio": statistics.median(cpu_ratios),
               "cpu_q1": _quantile(cpu_ratios, 0.25), "cpu_q3": _quantile(cpu_ratios, 0.75),
               "wall_ratio_median": statistics.median(walls), "max_abs_dloss": dloss,
               "steps_compared": min(len(losses_a), len(lb))}
        print(f"layout {args.layout}: meshtron/hand-written step time ratio "
              f"{res['ratio_median']:.3f} (median of {len(ratios)} pairs, quartiles "
              f"{res['ratio_q1']:.3f}..{res['ratio_q3']:.3f}, min {res['ratio_min']:.3f}, max "
              f"{res['ratio_max']:.3f}; pooled medians {res['pooled_ratio']:.3f}; best steps "
              f"{res['best_ratio']:.3f}); A {res['a_median_s']:.3f} s, "
              f"B {res['b_median_s']:.3f} s; whole-round wall ratio "
              f"{res['wall_ratio_median']:.3f}; CPU s/step (all ranks) A {res['cpu_a_s']:.3f} "
              f"B {res['cpu_b_s']:.3f}, ratio {res['cpu_ratio']:.3f} (median of pairs, quartiles "
              f"{res['cpu_q1']:.3f}..{res['cpu_q3']:.3f}); max |loss A - loss B| = {dloss:.2e} "
              f"over "
              f"{res['steps_compared']} steps", flush=True)
        Path(os.environ["TRAIN_OVERHEAD_OUT"]).write_text(json.dumps(res, indent=2))
    shutdown_rank(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
