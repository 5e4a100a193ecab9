"""The planner's answers, frozen: the JSON of varied `meshtron plan` commands against a saved
reference, so a change made for speed (caching, pruning, moving code) is shown to change no
answer. Each command runs in process through the CLI entry point, exactly as a user types it;
only the wall time of the search (`search_time_s`) is left out of the comparison.

    python bench/plan_answers.py            # compare with bench/results/plan_answers.json
    python bench/plan_answers.py --save     # write that reference (only from a trusted tree)

Exit 0 when every answer is identical, 1 with the first differing field of each case otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshtron.cli import main  # noqa: E402

REFERENCE = ROOT / "bench" / "results" / "plan_answers.json"
PINNED_405B = ["--model", "llama3-405b", "--cluster", "dgx-h100:1024", "--global-batch", "2048",
               "--seq-len", "8192", "--layout", "tp=8,cp=1,pp=16,dp=64", "--zero", "1",
               "--sp", "on", "--recompute", "none", "--micro-batch", "1",
               "--schedule", "interleaved", "--offload", "none"]
CASES: dict[str, list[str]] = {
    "dense-8b-open": ["--model", "llama3-8b", "--cluster", "dgx-h100:8", "--global-batch", "512",
                      "--seq-len", "8192"],
    "dense-70b-open": ["--model", "llama3-70b", "--cluster", "dgx-h100:64", "--global-batch",
                       "512", "--seq-len", "8192"],
    "dense-405b-open": ["--model", "llama3-405b", "--cluster", "dgx-h100:256", "--global-batch",
                        "2048", "--seq-len", "8192", "--top", "3"],
    "pinned-405b-nofit": PINNED_405B,
    "pinned-405b-fit": ["--model", "llama3-405b", "--cluster", "dgx-h100:1024",
                        "--global-batch", "2048", "--seq-len", "8192",
                        "--layout", "tp=8,cp=1,pp=16,dp=64"],
    "pinned-70b-nofit-tp1": ["--model", "llama3-70b", "--cluster", "dgx-h100:2",
                             "--global-batch", "64", "--seq-len", "4096",
                             "--layout", "tp=1,pp=1,dp=16", "--zero", "1"],
    "gpt3-175b-megatron2021": ["--model", "gpt3-175b", "--cluster", "dgx-a100:128",
                               "--global-batch", "1536", "--seq-len", "2048",
                               "--framework", "megatron@2021"],
    "70b-torchtitan": ["--model", "llama3-70b", "--cluster", "dgx-h100:32", "--global-batch",
                       "256", "--seq-len", "8192", "--framework", "torchtitan"],
    "13b-deepspeed": ["--model", "llama2-13b", "--cluster", "dgx-a100:8", "--global-batch",
                      "512", "--seq-len", "4096", "--framework", "deepspeed"],
    "70b-megatron2024-pinned": ["--model", "llama3-70b", "--cluster", "dgx-h100:8",
                                "--global-batch", "128", "--seq-len", "8192",
                                "--framework", "megatron@2024", "--layout", "tp=8,pp=4"],
    "8b-fp8": ["--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch", "256",
               "--seq-len", "8192", "--dtype", "fp8"],
    "70b-fp8-torchtitan": ["--model", "llama3-70b", "--cluster", "dgx-h100:16",
                           "--global-batch", "256", "--seq-len", "8192", "--dtype", "fp8",
                           "--framework", "torchtitan"],
    "8b-cp-long": ["--model", "llama3-8b", "--cluster", "dgx-h100:4", "--global-batch", "32",
                   "--seq-len", "65536"],
    "70b-cp-pinned": ["--model", "llama3-70b", "--cluster", "dgx-h100:16", "--global-batch",
                      "64", "--seq-len", "32768", "--layout", "tp=8,cp=4"],
    "70b-offload-one-node": ["--model", "llama3-70b", "--cluster", "dgx-h100:1",
                             "--global-batch", "64", "--seq-len", "4096"],
    "8b-offload-fixed": ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch",
                         "64", "--seq-len", "8192", "--offload", "full"],
    "mixtral-open": ["--model", "mixtral-8x7b", "--cluster", "dgx-h100:8", "--global-batch",
                     "256", "--seq-len", "4096"],
    "qwen3-30b-ep": ["--model", "qwen3-30b-a3b", "--cluster", "dgx-h100:2", "--global-batch",
                     "256", "--seq-len", "4096"],
    # Megatron-Core's zero 2/3 is Megatron-FSDP, which does not run with pipelines
    # (plan_rules_zero.PIPELINE_MAX): zero 1 under pp
    "405b-megatron2024-16k": ["--model", "llama3-405b", "--cluster", "dgx-h100:2048",
                              "--global-batch", "2048", "--seq-len", "8192", "--framework",
                              "megatron@2024", "--top", "3"],
    "deepseek-v3-pinned": ["--model", "deepseek-v3", "--cluster", "dgx-h100:256",
                           "--global-batch", "4096", "--seq-len", "4096",
                           "--layout", "tp=1,pp=16,ep=64", "--framework", "megatron@2024"],
    "405b-open-nofit": ["--model", "llama3-405b", "--cluster", "dgx-h100:2", "--global-batch",
                        "64", "--seq-len", "8192"],
    "pinned-fp8-nofit": ["--model", "llama3-70b", "--cluster", "dgx-h100:1", "--global-batch",
                         "64", "--seq-len", "8192", "--dtype", "fp8", "--layout", "tp=1,pp=1",
                         "--recompute", "none", "--micro-batch", "2"],
    "pinned-moe-nofit": ["--model", "qwen3-235b-a22b", "--cluster", "dgx-h100:4",
                         "--global-batch", "256", "--seq-len", "4096",
                         "--layout", "tp=1,pp=4,ep=8", "--zero", "1", "--recompute", "none",
                         "--framework", "megatron@2024"],
    "tiny-cpu-refused": ["--model", "debug", "--cluster", "dgx-h100:1", "--global-batch", "7",
                         "--seq-len", "64", "--layout", "tp=1,pp=1,dp=8"],
    "gpt3-zero3-replicate": ["--model", "gpt3-175b", "--cluster", "dgx-h100:32",
                             "--global-batch", "1024", "--seq-len", "2048", "--zero", "3",
                             "--dp-replicate", "2"],
    # torchtitan's gradient accumulation around pp_schedule.step: 4 schedule calls per step
    "70b-torchtitan-pp-runs": ["--model", "llama3-70b", "--cluster", "dgx-h100:8",
                               "--global-batch", "512", "--seq-len", "8192", "--framework",
                               "torchtitan", "--layout", "tp=8,pp=4,dp=2", "--zero", "3",
                               "--micro-batch", "1", "--pipeline-runs", "4"],
}


def answer(argv: list[str]) -> dict:
    """The exit code and JSON (or one-line refusal) of `meshtron plan argv --json`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv, "--json"])
    if code != 0:
        return {"exit": code, "stderr": err.getvalue().strip()}
    doc = json.loads(out.getvalue())
    _drop_timing(doc)
    return {"exit": code, "json": doc}


def _drop_timing(doc) -> None:
    """The wall time of the search is the one field that differs from run to run."""
    if isinstance(doc, dict):
        doc.pop("search_time_s", None)
        for v in doc.values():
            _drop_timing(v)
    elif isinstance(doc, list):
        for v in doc:
            _drop_timing(v)


def dump(answers: dict) -> str:
    """One case a line (a change of answer shows as the lines of the cases it moves)."""
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True, separators=(',', ':'))}"
             for k, v in sorted(answers.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def first_difference(a, b, where: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{where or '.'}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{where}.{k}: only in {'reference' if k in a else 'now'}"
            d = first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{where or '.'}: {a!r} != {b!r}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", action="store_true",
                   help="write the answers as the new reference instead of comparing with it")
    return p.parse_args(argv)


def main_(argv: list[str]) -> int:
    args = parse_args(argv)
    answers, total = {}, 0.0
    for name, case in CASES.items():
        t = time.perf_counter()
        answers[name] = answer(case)
        dt = time.perf_counter() - t
        total += dt
        print(f"{name:<28} exit {answers[name]['exit']}  {dt:7.3f} s")
    print(f"{'all':<28}         {total:7.3f} s")
    if args.save:
        REFERENCE.write_text(dump(answers))
        print(f"saved {REFERENCE.relative_to(ROOT)}")
        return 0
    reference = json.loads(REFERENCE.read_text())
    # through JSON both ways, so tuples and lists compare alike
    answers = json.loads(json.dumps(answers))
    bad = 0
    for name in CASES:
        d = first_difference(reference.get(name), answers[name], name)
        if d:
            bad += 1
            print(f"DIFFERENT {d}")
    print(f"{len(CASES) - bad}/{len(CASES)} answers identical to {REFERENCE.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main_(sys.argv[1:]))
