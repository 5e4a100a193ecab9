"""Step time on a bandwidth-limited link: uncompressed vs int8 gradients vs DiLoCo.

Two Linux network namespaces ("nodes") joined by a veth pair, each end shaped with `tc` (token
bucket filter) to the link rate; gloo runs over that link only (GLOO_SOCKET_IFNAME = the veth
end), so every byte between the two groups of ranks crosses the shaped link. The script creates
the namespaces itself and removes them at the end (also on failure); it shapes nothing outside
them (the host's loopback is untouched). Needs root (`ip netns`, `tc`).

Each configuration trains the "tiny" model (3.0M parameters, 11.6 MiB of fp32 gradients) with
dp = 2 x ranks-per-namespace on byte-tokenized stdlib sources, same seed and data, and reports
the mean step time after the first 8 steps (whole DiLoCo rounds: its sync steps count), the
speed-up over uncompressed data parallelism and
the final loss; the loss curves of all configurations at the slowest rate go to one PNG.

    sudo .venv/bin/python bench/compress_netns.py                      # 1 and 10 Gbit/s
    sudo .venv/bin/python bench/compress_netns.py --rates 1gbit --steps 40 --png runs/x.png

Goal (issue 12): int8 and DiLoCo >= 2x faster than uncompressed at 1 Gbit/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIGS = {  # label -> plan fields beyond dp
    "fp32": {},
    "int8": {"grad_compression": "int8"},
    "diloco H=8": {"diloco": 8},
    "diloco H=8 int8": {"diloco": 8, "grad_compression": "int8"},
}
SEQ = 64
ROWS_PER_RANK = 1
WARMUP = 8
"""Steps left out of the timing: one DiLoCo round (H=8), so the timed steps are whole rounds."""


# ---- namespaces ----------------------------------------------------------------------------
class Link:
    """Two namespaces A, B and a shaped veth pair between them (10.77.<k>.1 / .2)."""

    def __init__(self, rate: str):
        tag = os.getpid() % 100000
        self.ns = (f"mtA{tag}", f"mtB{tag}")
        self.dev = (f"mvA{tag}", f"mvB{tag}")
        k = tag % 200 + 20
        self.ip = (f"10.77.{k}.1", f"10.77.{k}.2")
        self.rate = rate

    def __enter__(self) -> "Link":
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, ip in zip(self.ns, self.dev, self.ip):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                # gloo keeps one TCP connection per peer and pauses it during compute; without
                # this, every step restarts from TCP slow start (usual tuning for training over
                # TCP; applies to all configurations alike, inside the namespaces only)
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                      "net.ipv4.tcp_slow_start_after_idle=0"])
                # token bucket: a burst of ~10 ms at the rate (at least 512 KiB), queue <= 100 ms
                burst = max(512 * 1024, int(_bits(self.rate) / 8 / 100))
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                      "tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:  # deleting a namespace deletes the veth end inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    return float(rate)


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def namespaces_work() -> str | None:
    """None when `ip netns add` works here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns / tc)"
    name = f"mtchk{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


# ---- one configuration over the link ----------------------------------------------------------
def run_config(link: Link, label: str, per_ns: int, steps: int, tokens_path: str,
               out_dir: Path) -> dict:
    world = 2 * per_ns
    port = 29500 + os.getpid() % 1000
    out = out_dir / f"{label.replace(' ', '_').replace('=', '')}.json"
    procs = []
    for rank in range(world):
        side = rank // per_ns
        env = dict(os.environ, MASTER_ADDR=link.ip[0], MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_ns),
                   LOCAL_WORLD_SIZE=str(per_ns), GLOO_SOCKET_IFNAME=link.dev[side],
                   OMP_NUM_THREADS="1")
        cmd = ["ip", "netns", "exec", link.ns[side], sys.executable, __file__, "--worker",
               "--config", label, "--steps", str(steps), "--tokens", tokens_path,
               "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode)
        raise RuntimeError(f"{label}: rank {bad} failed:\n{logs[bad][-3000:]}")
    return json.loads(out.read_text())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from meshtron.compress import diloco as dl
    from meshtron.model import Transformer, preset
    from meshtron.parallel import build_mesh, build_optimizer, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    link = _link_rate(rank)
    plan = dict(dp=world, **CONFIGS[args.config])
    mesh = build_mesh(plan, world, device_type="cpu")
    torch.manual_seed(0)
    pm = parallelize(Transformer(preset("tiny")), plan, mesh)
    opt = build_optimizer(pm, lr=3e-3)
    outer = dl.attach(pm, pm.layout)
    tokens = torch.load(args.tokens)
    losses, times = [], []
    for step in range(args.steps):
        batch = tokens[step, rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]
        t0 = time.perf_counter()
        loss = pm.forward_backward(batch[:, :-1], batch[:, 1:])
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if outer is not None:
            outer.after_inner_step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"losses": losses, "times": times,
                                              "link_mb_per_s": link}))
    dist.destroy_process_group()


def _link_rate(rank: int) -> float | None:
    """MB/s of one 16 MiB send from rank 0 to the last rank (across the link)."""
    import torch
    import torch.distributed as dist

    last = dist.get_world_size() - 1
    buf = torch.zeros(4 << 20)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(buf, last)
        dist.recv(buf[:1], last)
    elif rank == last:
        dist.recv(buf, 0)
        dist.send(buf[:1], 0)
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e6 if rank == 0 else None


def demo_tokens(steps: int, rows: int):
    from meshtron.data.corpus import stdlib_documents
    from meshtron.data.tokenizer import ByteTokenizer

    import torch

    text = "\n".join(stdlib_documents(max_bytes=2_000_000))
    ids = torch.tensor(ByteTokenizer().encode(text)[: steps * rows * (SEQ + 1)])
    return ids.view(steps, rows, SEQ + 1)


def plot(curves: dict[str, list[float]], rate: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    w = 4  # one step is 2 x 64 tokens: a moving mean over 4 steps shows the trend
    for label, losses in curves.items():
        smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss, mean of {w} steps (nats/token)")
    ax.set_title(f"tiny model, dp=2 over a {rate} veth link (gloo)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--tokens", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rates", default="1gbit,10gbit", help="tc rates, comma-separated")
    p.add_argument("--steps", type=int, default=32, help="training steps per configuration")
    p.add_argument("--ranks-per-ns", type=int, default=1, help="ranks in each namespace")
    p.add_argument("--png", default="runs/compress_netns.png", help="loss curves (first rate)")
    args = p.parse_args()
    if not args.worker and (args.steps <= WARMUP or (args.steps - WARMUP) % 8):
        p.error(f"--steps {args.steps}: must be {WARMUP} + a multiple of 8 (whole DiLoCo rounds)")
    if args.worker:
        worker(args)
        return
    why = namespaces_work()
    if why:
        print(f"compress_netns: cannot create network namespaces here: {why}")
        sys.exit(1)
    per_ns = args.ranks_per_ns
    rows = ROWS_PER_RANK * 2 * per_ns
    with tempfile.TemporaryDirectory() as tmp:
        import torch

        tokens_path = str(Path(tmp) / "tokens.pt")
        torch.save(demo_tokens(args.steps, rows), tokens_path)
        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        print(f"tiny model (3.0M params, 11.6 MiB fp32 gradients), dp={2 * per_ns} "
              f"({per_ns} rank(s) per namespace), {rows} x {SEQ} tokens per step, "
              f"{args.steps} steps; mean step time of steps 9..{args.steps}")
        print(f"{'link':>7} {'measured':>10} {'config':>16} {'step s':>8} {'speed-up':>9} "
              f"{'final loss':>11}")
        for i, rate in enumerate(rates):
            curves = {}
            with Link(rate) as link:
                base = None
                for label in CONFIGS:
                    r = run_config(link, label, per_ns, args.steps, tokens_path, Path(tmp))
                    med = statistics.mean(r["times"][WARMUP:])
                    base = base or med
                    curves[label] = r["losses"]
                    final = statistics.mean(r["losses"][-4:])
                    print(f"{rate:>7} {r['link_mb_per_s']:7.0f} MB/s {label:>16} {med:8.3f} "
                          f"{base / med:8.2f}x {final:11.4f}", flush=True)
            if i == 0:
                plot(curves, rate, ROOT / args.png)
                print(f"loss curves at {rate}: {args.png}")


if __name__ == "__main__":
    main()
