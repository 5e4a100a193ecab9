"""Peak resident memory per rank when starting a model that does not fit whole on a rank, and
the speed of loading it from safetensors, side by side:

  meta  the model built on the meta device, sharded by `parallelize` (ZeRO-3 over 4 ranks),
        only this rank's shards materialized and initialized (meshtron/model/init.py);
  full  what every rank did before: build the whole model on the CPU from the seed, then let
        `parallelize` keep its shard.

Each rank reports its peak RSS (getrusage ru_maxrss) minus its RSS before the model existed
(torch, the process group and the mesh already up), next to the bytes of the parameter shard it
holds; the goal is peak <= 1.3 x shard + fixed buffers (the init block, 16 MiB). ("file-backed"
is the growth of the pages mapped from files: safetensors memory-maps the checkpoint, and the
pages a rank reads stay resident, and counted in RSS, until the kernel reclaims them.) Then the
meta-initialized model is exported (safetensors, one file per stage) and loaded back with
`--init-from`'s reader on a fresh meta model: every rank reads only its slices; printed are
MB/s per rank and in total.

    .venv/bin/python bench/meta_init_memory.py                  # ~0.5B-parameter Llama, 4 ranks
    .venv/bin/python bench/meta_init_memory.py --layers 4 --nproc 2
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path


def _rss_now() -> int:
    """Current resident bytes (from /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _file_rss() -> int:
    """Resident bytes of file-backed pages (the memory-mapped safetensors files count here)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_fn(spec_fields: dict, mode: str, folder: str | None) -> dict:
    import torch
    import torch.distributed as dist

    from meshtron.hf import load_into
    from meshtron.model.init import local_tensor
    from meshtron.model.spec import ModelSpec
    from meshtron.model.transformer import Transformer
    from meshtron.parallel import build_mesh, parallelize

    spec = ModelSpec(**spec_fields)
    plan = {"dp": dist.get_world_size(), "zero": 3}
    mesh = build_mesh(plan, dist.get_world_size(), device_type="cpu", spec=spec)
    # Warm-up on a tiny model: imports and lazy set-up of FSDP2 / DTensor are not the model's.
    with torch.device("meta"):
        warm = Transformer(ModelSpec(name="warm", layers=1, hidden=64, heads=2, kv_heads=1,
                                     ffn_hidden=64, vocab=64, max_seq=16))
    warm_pm = parallelize(warm, plan, mesh)
    del warm_pm, warm
    dist.barrier()
    base, base_file = _rss_now(), _file_rss()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    fill = None
    if mode == "load":
        fill = lambda parts: load_into(parts, folder, spec)  # noqa: E731
    if mode == "full":
        model = Transformer(spec)
    else:
        with torch.device("meta"):
            model = Transformer(spec)
    pm = parallelize(model, plan, mesh, fill=fill)
    seconds = time.perf_counter() - t0
    shard = sum(local_tensor(p).numel() * local_tensor(p).element_size()
                for p in pm.parameters())
    out = {"base": base, "peak": _peak_rss(), "shard": shard, "seconds": seconds,
           "file": _file_rss() - base_file}
    if mode == "meta" and folder is not None:
        from meshtron.hf import export_parallel

        export_parallel(pm, spec, folder)
    dist.barrier()
    return out


def _run(spec_fields: dict, mode: str, nproc: int, folder: str | None) -> list[dict]:
    import meta_init_memory as me  # importable by the ranks (this folder is on sys.path)

    sys.path.append(str(Path(__file__).resolve().parent.parent))  # testkit/
    from testkit.multiproc import run_on_ranks

    return run_on_ranks(me.rank_fn, nproc, spec_fields, mode, folder, timeout=3600)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--skip-full", action="store_true", help="skip the whole-model baseline")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from meshtron.model.spec import ModelSpec

    h = args.hidden
    fields = dict(name="bench", layers=args.layers, hidden=h, heads=h // 128,
                  kv_heads=max(1, h // 512), ffn_hidden=int(h * 2.75) // 64 * 64, vocab=32000,
                  max_seq=2048)
    spec = ModelSpec(**fields)
    gib = spec.num_params() * 4 / 2**30
    print(f"model: {spec.num_params() / 1e6:.0f}M parameters, {gib:.2f} GiB in fp32; "
          f"{args.nproc} ranks, ZeRO-3")
    with tempfile.TemporaryDirectory(prefix="meshtron-bench-") as tmp:
        rows = {"meta": _run(fields, "meta", args.nproc, tmp)}
        rows["load"] = _run(fields, "load", args.nproc, tmp)
        if not args.skip_full:
            rows["full"] = _run(fields, "full", args.nproc, None)
        size = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
    print(f"{'init':<6}{'rank':>5}{'shard MiB':>11}{'peak-base MiB':>15}{'ratio':>8}{'s':>7}"
          f"{'file-backed MiB':>17}")
    for mode, results in rows.items():
        for r, res in enumerate(results):
            grown = (res["peak"] - res["base"]) / 2**20
            shard = res["shard"] / 2**20
            print(f"{mode:<6}{r:>5}{shard:>11.0f}{grown:>15.0f}{grown / shard:>8.2f}"
                  f"{res['seconds']:>7.1f}{res['file'] / 2**20:>17.0f}")
    load_s = max(res["seconds"] for res in rows["load"])
    per_rank = [res["shard"] / 2**20 / res["seconds"] for res in rows["load"]]
    print(f"load from safetensors ({size / 2**20:.0f} MiB on disk): {size / 2**20 / load_s:.0f} "
          f"MB/s in total, {min(per_rank):.0f}-{max(per_rank):.0f} MB/s per rank")
    if "full" in rows:
        meta = max(r["peak"] - r["base"] for r in rows["meta"])
        full = max(r["peak"] - r["base"] for r in rows["full"])
        print(f"peak growth per rank, full / meta: {full / meta:.1f}x "
              f"({full / 2**20:.0f} MiB vs {meta / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
