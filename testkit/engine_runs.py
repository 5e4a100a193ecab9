"""What the small equivalence tests share: their training config (`train_cfg`), seeded token
batches (`token_batches`), and `engine_runs`: a list of (config, plan) cases trained with
meshtron's ParallelEngine on this rank, each on its data-parallel rank's rows of the same
global batches, returning per-step losses and the rank's parameter, gradient and optimizer
bytes. `engine_runs` runs on every rank of a `testkit.multiproc.run_on_ranks` launch; a barrier
after each case."""

from __future__ import annotations

from typing import Any, Callable


def train_cfg(model: str, steps: int, tmp=None, micro: int = 2, **train):
    """The small training config these tests share: sequences of 32 tokens, global batch 8 in
    micro-batches of `micro`, `steps` steps, no evaluation during training; `train` overrides
    the [train] table (e.g. dtype), `tmp` its run folder."""
    from meshtron.config import config_from_dict

    return config_from_dict({
        "model": model,
        "data": {"seq_len": 32, "global_batch": 8, "micro_batch": micro, "eval_batches": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": steps, "eval_every": 0, "log_every": 1,
                  **({"run_dir": str(tmp)} if tmp is not None else {}), **train},
    })


def token_batches(vocab: int, steps: int) -> list:
    """`steps` global batches of 8 sequences of 33 tokens (inputs and shifted targets), seeded."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (8, 33), generator=g) for _ in range(steps)]


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
