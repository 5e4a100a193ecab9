"""Branch-Train-MiX on this machine: two dense branches of one base, merged, against each branch.

Two corpora every CPython install has: Python code (the standard library's .py files, as
`--data stdlib` reads them, pydoc_data left out) and English prose (the reference manual's
topics in `pydoc_data.topics`, about 0.46 MB). Each is cut into train and eval documents (every
10th document held out); the union's train folder holds both train parts.

    base      dense model, BASE_STEPS on the union
    branch A  from base, BRANCH_STEPS on code       branch B  from base, BRANCH_STEPS on prose
    merged    `meshtron merge --experts A B` (top-2 of 2 experts), then EXTRA_STEPS on the union
    A+, B+    each branch continued EXTRA_STEPS on the union (the same steps, data and schedule)
    base+     (--dense-reference) the base continued BRANCH_STEPS + EXTRA_STEPS on the union

Every run is `meshtron train` / `meshtron merge` as a user runs them, called in this process
(fp32, byte tokenizer, the `debug` model: 2 blocks of width 64; same seed, batch, learning
rate and schedule shape; sized for a shared 2-core machine). The eval loss of each final
model is measured here on fixed windows of both eval parts (never trained on), and the union's
is their mean. `--top-k 1` merges sparsely (one expert per token: the active parameters of a
branch).

    .venv/bin/python bench/btx.py [--out DIR] [--top-k 2]     # 1-10 min on 2 shared cores (load)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = ["--model", "debug"]
BATCH = ["--seq-len", "64", "--global-batch", "8", "--lr", "3e-3", "--seed", "0",
         "--eval-every", "0", "--log-every", "10"]
BASE_STEPS, BRANCH_STEPS, EXTRA_STEPS = 40, 200, 80
EVAL_WINDOWS = 64
SEQ = 64


def corpora(root: Path) -> dict[str, Path]:
    """Write code/, prose/ (train/ and eval/ each) and union/train under `root`."""
    from pydoc_data.topics import topics

    from meshtron.data.corpus import stdlib_files, stdlib_root

    prose = [topics[k] for k in sorted(topics)]
    budget = sum(len(t.encode()) for t in prose)
    base = stdlib_root()
    code, size = [], 0
    for rel, n in stdlib_files(10 * budget):
        if rel.startswith("pydoc_data/"):
            continue
        code.append((base / rel).read_text(errors="replace"))
        size += n
        if size >= budget:
            break
    out = {}
    for name, docs in (("code", code), ("prose", prose)):
        for i, doc in enumerate(docs):
            part = "eval" if i % 10 == 9 else "train"
            for where in ([name] if part == "eval" else [name, "union"]):
                path = root / where / part / f"{name}_{i:04d}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(doc)
        out[name] = root / name
    out["union"] = root / "union"
    return out


def meshtron(*args: str) -> None:
    """A meshtron command, in this process (one torch import for the whole bench)."""
    import contextlib
    import io

    from meshtron.cli import main

    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        code = main(list(args))
    if code:
        raise SystemExit(f"meshtron {' '.join(args[:3])}... failed:\n{log.getvalue()[-2000:]}")


def train(run: Path, data: Path, steps: int, init: Path | None = None) -> Path:
    """A run of `steps` steps on `data`; returns its exported weights folder."""
    args = ["train", "--data", str(data), "--steps", str(steps), "--warmup-steps",
            str(max(1, steps // 10)), "--run-dir", str(run), "--export", str(run / "weights"),
            "--checkpoint-every", str(steps), *BATCH]
    meshtron(*(args + (["--init-from", str(init)] if init else MODEL)))
    return run / "weights"


def eval_loss(weights: Path, eval_dirs: dict[str, Path]) -> dict[str, float]:
    """Mean loss of the model in `weights` on EVAL_WINDOWS fixed windows of each eval part."""
    import numpy as np
    import torch

    from meshtron.data.pipeline import load_corpus
    from meshtron.model.transformer import Transformer
    from meshtron.modular.branches import describe, load_state
    from meshtron.modular.upcycle import load_state as fill

    branch = describe(weights)
    model = Transformer(branch.spec, init_seed=0)
    fill(model, load_state(branch))
    model.eval()
    out = {}
    for name, folder in eval_dirs.items():
        corpus, _ = load_corpus(folder)
        tokens = np.concatenate([corpus.train, corpus.eval]).astype(np.int64)
        starts = np.linspace(0, len(tokens) - SEQ - 2, EVAL_WINDOWS).astype(np.int64)
        x = torch.from_numpy(np.stack([tokens[s:s + SEQ + 1] for s in starts]))
        with torch.no_grad():
            out[name] = float(model(x[:, :-1], x[:, 1:]))
    out["union"] = (out["code"] + out["prose"]) / 2
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="work folder (default: a temporary one)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--base-steps", type=int, default=BASE_STEPS)
    p.add_argument("--branch-steps", type=int, default=BRANCH_STEPS)
    p.add_argument("--extra-steps", type=int, default=EXTRA_STEPS)
    p.add_argument("--dense-reference", action="store_true",
                   help="also continue the base for BRANCH_STEPS + EXTRA_STEPS on the union")
    args = p.parse_args()
    base_steps, branch_steps, extra_steps = args.base_steps, args.branch_steps, args.extra_steps
    root = Path(args.out or tempfile.mkdtemp(prefix="btx-"))
    t0 = time.time()
    data = corpora(root / "data")
    evals = {"code": data["code"] / "eval", "prose": data["prose"] / "eval"}
    base = train(root / "base", data["union"] / "train", base_steps)
    branch = {n: train(root / f"branch_{n}", data[n] / "train", branch_steps, base)
              for n in ("code", "prose")}
    merged_dir = root / "merged"
    meshtron("merge", "--experts", str(root / "branch_code"), str(root / "branch_prose"),
             "--to", str(merged_dir), "--top-k", str(args.top_k))
    finals = {"merged (BTX)": train(root / "merged_run", data["union"] / "train", extra_steps,
                                    merged_dir)}
    for n in ("code", "prose"):
        finals[f"branch {n} +"] = train(root / f"cont_{n}", data["union"] / "train",
                                        extra_steps, branch[n])
    if args.dense_reference:
        finals["base +"] = train(root / "cont_base", data["union"] / "train",
                                 branch_steps + extra_steps, base)
    rows = {"base": eval_loss(base, evals), "branch code": eval_loss(branch["code"], evals),
            "branch prose": eval_loss(branch["prose"], evals),
            "merged, step 0": eval_loss(merged_dir, evals)}
    rows.update({k: eval_loss(v, evals) for k, v in finals.items()})
    print(f"steps: base {base_steps}, branches {branch_steps}, extra {extra_steps} "
          f"(union; base + {branch_steps + extra_steps}); top-{args.top_k} of 2 experts; "
          f"{time.time() - t0:.0f} s")
    print(f"{'model':16s} {'code':>7s} {'prose':>7s} {'union':>7s}")
    for name, r in rows.items():
        print(f"{name:16s} {r['code']:7.4f} {r['prose']:7.4f} {r['union']:7.4f}")
    best = min(rows[f"branch {n} +"]["union"] for n in ("code", "prose"))
    print(f"merged / best continued branch, union eval loss: "
          f"{rows['merged (BTX)']['union'] / best:.4f}")
    (root / "btx.json").write_text(json.dumps(rows, indent=2))
    print(f"results in {root / 'btx.json'}")


if __name__ == "__main__":
    main()
