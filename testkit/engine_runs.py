"""Train a list of (config, plan) cases with meshtron's ParallelEngine on this rank, each on
its data-parallel rank's rows of the same global batches, and return what the equivalence
tests compare (per-step losses; the rank's parameter, gradient and optimizer bytes). Runs on
every rank of a `testkit.multiproc.run_on_ranks` launch; a barrier after each case."""

from __future__ import annotations

from typing import Any, Callable


def engine_runs(cases: list[tuple[Any, Any]], batches: Callable[[int], list]) -> list[dict]:
    """`cases`: (TrainConfig, Plan) pairs; `batches(vocab)`: the global token batches, every
    rank the same ones, [rows, seq + 1] each."""
    import torch
    import torch.distributed as dist

    from meshtron.train.parallel import ParallelEngine

    torch.set_num_threads(1)
    out = []
    for cfg, plan in cases:
        engine = ParallelEngine(cfg, plan, torch.device("cpu"))
        losses = []
        for tokens in batches(cfg.model.vocab):
            rows = tokens.shape[0] // plan.dp
            part = tokens[rows * engine.dp_rank:rows * (engine.dp_rank + 1)]
            losses.append(float(engine.train_step(part[:, :-1], part[:, 1:]).loss))
        m = engine.memory_bytes()
        out.append({"losses": losses, "states": [m["params"], m["grads"], m["optimizer"]]})
        engine.release()
        dist.barrier()
    return out
