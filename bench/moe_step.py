"""MoE step time against a dense model of the same active parameters, side by side in one run.

"tiny-moe" (8 SwiGLU experts of width 96, top-2, softmax router + auxiliary loss) against the
same model with a dense SwiGLU of width 2 * 96 = 192 in every block (equal active parameters but
the router: 0.56M active each). One forward + backward + AdamW step on 4 x 256 tokens, fp32, one
thread; the two models alternate, 3 warm-up rounds, median of ROUNDS. The MoE path on CPU is the
exact fallback (sort by expert, one matmul per expert): the ratio is the cost of routing,
sorting and 8 small GEMMs instead of one, not what grouped GEMMs on a GPU give.

    .venv/bin/python bench/moe_step.py        # about 1 min on 2 cores
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROUNDS = 10


def main() -> None:
    import torch

    from meshtron.model.spec import PRESETS
    from meshtron.model.transformer import Transformer, cross_entropy_loss

    torch.set_num_threads(1)
    moe = PRESETS["tiny-moe"]
    dense = moe.replace(name="tiny-dense-active", moe_experts=0, moe_top_k=0, moe_ffn_hidden=0,
                        moe_aux_loss=0.0, ffn_hidden=moe.moe_top_k * moe.moe_ffn_hidden)
    x = torch.randint(0, 256, (4, 257), generator=torch.Generator().manual_seed(0))
    runs = {}
    for spec in (moe, dense):
        model = Transformer(spec, init_seed=0)
        runs[spec.name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [])

    def step(model, opt):
        cross_entropy_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()

    for r in range(3 + ROUNDS):
        for name, (model, opt, times) in runs.items():
            t0 = time.perf_counter()
            step(model, opt)
            if r >= 3:
                times.append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, (_, _, t) in runs.items()}
    for spec in (moe, dense):
        print(f"{spec.name:18s} total {spec.num_params() / 1e6:.2f}M active "
              f"{spec.active_params() / 1e6:.2f}M  step {med[spec.name] * 1e3:.0f} ms")
    print(f"moe / dense step time: {med[moe.name] / med[dense.name]:.2f}")


if __name__ == "__main__":
    from bench.help_only import help_only

    help_only(__doc__)
    main()
