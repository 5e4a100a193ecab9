"""Parameter initialization time of one rank's shard of a large model (meshtron/model/init.py),
the way `materialize` runs it: every parameter's local box drawn from the deterministic,
layout-invariant initialization into fresh storage on `--device`.

Shards of rank 0 of eight, for the 8B Llama-3 shape by default:

  full    the whole model (one process, `meshtron train` without a plan);
  fsdp8   ZeRO-3 over 8 ranks: every parameter's dim-0 chunk (FSDP2's Shard(0));
  tp8     Megatron tensor parallelism over 8 ranks: wq/wk/wv/w1/w3/output and the token
          embedding by rows (Shard(0)), wo/w2 by columns (Shard(1)), norms whole.

`--geometry tiles` draws the accelerators' 2-D tiles on the CPU (the work a GPU does, timed
on the host). Printed per case: elements held, wall seconds, process CPU seconds and elements per wall second
(the machine's load shows as CPU < wall x threads). Compare two versions of init.py by running
this script on each checkout.

    .venv/bin/python bench/init_speed.py                       # llama3-8b, fsdp8 and tp8 on CPU
    .venv/bin/python bench/init_speed.py --cases full --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import time


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cases", default="fsdp8,tp8", help="comma list of full, fsdp8, tp8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--geometry", choices=("rows", "tiles"), default=None,
                    help="tile geometry (default: the device's, rows on the CPU)")
    return ap


if __name__ == "__main__":
    _parser().parse_args()  # --help and bad options answered before torch loads

import torch  # noqa: E402

from meshtron.hf.load import model_shapes  # noqa: E402
from meshtron.model import init as minit  # noqa: E402
from meshtron.model.spec import preset  # noqa: E402

COLUMN_SHARDED = ("attention.wo.weight", "feed_forward.w2.weight")


def rank0_box(name: str, shape: tuple[int, ...], case: str) -> tuple[tuple, tuple]:
    """(offset, local shape) of rank 0's part of parameter `name` under `case`."""
    if case == "full" or len(shape) < 2:
        return (0,) * len(shape), shape
    dim = 1 if case == "tp8" and name.endswith(COLUMN_SHARDED) else 0
    local = list(shape)
    local[dim] = math.ceil(shape[dim] / 8)  # torch.chunk's first chunk
    return (0,) * len(shape), tuple(local)


def run_case(spec, case: str, device: torch.device, seed: int, geometry: str | None) -> dict:
    shapes = model_shapes(spec)
    boxes = {n: rank0_box(n, s, case) for n, s in shapes.items()}
    outs = {n: torch.empty(local, device=device) for n, (_, local) in boxes.items()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for name, (offset, _) in boxes.items():
        minit.init_into(outs[name], name, shapes[name], offset, seed, spec.layers,
                        **({"geometry": geometry} if geometry else {}))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    held = sum(t.numel() for t in outs.values())
    return {"case": case, "model": spec.name, "device": str(device),
            "geometry": geometry or getattr(minit, "geometry_for", lambda d: "rows")(device),
            "elements": held,
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "threads": torch.get_num_threads(), "elements_per_s": round(held / wall)}


def main() -> None:
    args = _parser().parse_args()
    spec = preset(args.model)
    for case in args.cases.split(","):
        print(json.dumps(run_case(spec, case, torch.device(args.device), args.seed,
                                  args.geometry)), flush=True)


if __name__ == "__main__":
    main()
