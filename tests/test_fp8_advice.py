"""`meshtron plan --dtype fp8` on meshtron's eager stack says when FP8 is priced slower than
bf16, and what compiled blocks make of it (audit s54, finding 2: llama3-8b on 8 H100 was 5.52 s
at fp8 against 3.63 s at bf16, silently). The note's figures are the best plans that
`plan --dtype bf16` and `plan --stack compiled` print: read back through the same command."""

from __future__ import annotations

import json
import re

from testkit.cli_inproc import meshtron_main

PLAN = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
        "--seq-len", "4096", "--top", "1"]


def _best_step(*flags: str) -> tuple[float, list[str]]:
    rc, out, err = meshtron_main(*PLAN, "--json", *flags)
    assert rc == 0, err
    answer = json.loads(out)
    return answer["plans"][0]["step_time_s"], answer["notes"]


def _note(notes: list[str]) -> str | None:
    return next((n for n in notes if n.startswith("FP8 on the eager stack")), None)


def test_fp8_slower_than_bf16_on_the_eager_stack_is_said_with_the_compiled_figures():
    fp8, notes = _best_step("--dtype", "fp8")
    bf16, bf16_notes = _best_step("--dtype", "bf16")
    fp8_c, fp8_c_notes = _best_step("--dtype", "fp8", "--stack", "compiled")
    bf16_c, _ = _best_step("--dtype", "bf16", "--stack", "compiled")
    assert bf16 < fp8 and fp8_c < bf16_c  # the premise: eager FP8 loses, compiled FP8 wins
    note = _note(notes)
    assert note is not None, notes
    said = [float(x) for x in re.findall(r"(\d+\.\d+) s", note)]
    assert said == [float(f"{t:.3g}") for t in (fp8, bf16, fp8_c, bf16_c)], note
    assert "make FP8 pay" in note and "train --compile" in note
    # where it is not true it is not said: bf16 asked for, or the compiled stack priced
    assert _note(bf16_notes) is None and _note(fp8_c_notes) is None
    rc, out, _ = meshtron_main(*PLAN, "--dtype", "fp8")  # and the table's reader sees it
    assert rc == 0 and "Note: FP8 on the eager stack is slower than bf16 here" in out


def test_the_note_never_refuses_the_plan_asked_for():
    """Audit s55 review: `plan --dtype fp8 --schedule zb` failed (exit 2) with 'plan.compile=
    true with plan.schedule=zb', a flag the user never gave: the note's compiled search ran on
    the user's knobs and its refusal ended the command. The plan is printed; the note keeps
    what it can compare (eager FP8 against bf16 on the same knobs) and names no compiled
    figures it could not price."""
    fp8, notes = _best_step("--dtype", "fp8", "--schedule", "zb")
    bf16, _ = _best_step("--dtype", "bf16", "--schedule", "zb")
    assert bf16 < fp8  # the premise: eager FP8 loses on zero bubble too
    note = _note(notes)
    assert note is not None, notes
    said = [float(x) for x in re.findall(r"(\d+\.\d+) s", note)]
    assert said == [float(f"{t:.3g}") for t in (fp8, bf16)], note
    assert "compiled" not in note, note
