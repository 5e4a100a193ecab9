"""The FP8 note of `meshtron plan`: on meshtron's eager stack FP8 can be priced slower than bf16
(torchao's Float8Linear casts, transposes and amax reductions run as separate eager kernels that
read and write each operand again: planner/fp8.py `cast_bytes`), and the user who asked for
--dtype fp8 is told so, and what compiled blocks (train --compile: the casts fused into the
neighbouring kernels by Inductor) make of it. Said only when it is true: the same search is run
at bf16 and compiled, and the note gives the four best step times it compares."""

from __future__ import annotations

from typing import Any


def _best_step(result, knobs: dict[str, Any], framework: Any, **changed) -> float | None:
    """The best step time of the same search with `changed`; None when nothing fits or the
    user's other knobs refuse the change (`--schedule zb` refuses compiled blocks: the note
    must not turn a plan the user asked for into that refusal, audit s55)."""
    from meshtron.errors import UserError
    from meshtron.planner.search import search_plans

    try:
        found = search_plans(result.model, result.cluster, result.global_batch, result.seq_len,
                             {**knobs, **changed}, top_k=1, explain=False, framework=framework)
    except UserError:
        return None
    return found.best.step_time_s if found.fits else None


def fp8_note(result, knobs: dict[str, Any], framework: Any = None) -> str | None:
    """One line when an FP8 plan on meshtron's eager stack is slower than bf16's best plan
    (with what compiled blocks give both); None otherwise (bf16 slower, another stack, a
    compiled or fused stack, nothing fits)."""
    runtime = framework is None or framework.name == "meshtron"
    if not (runtime and result.fits and result.dtype == "fp8"
            and result.options.stack == "eager" and not knobs.get("compile")):
        return None
    fp8 = result.best.step_time_s
    bf16 = _best_step(result, knobs, framework, dtype="bf16")
    if bf16 is None or bf16 >= fp8:  # FP8 pays eagerly already: nothing to say
        return None
    words = (f"FP8 on the eager stack is slower than bf16 here ({fp8:.3g} s against {bf16:.3g} s "
             "per step, each dtype's best plan): torchao's eager casts cost more than the FP8 "
             "GEMMs save")
    fp8_c = _best_step(result, knobs, framework, compile=True)
    bf16_c = _best_step(result, knobs, framework, dtype="bf16", compile=True)
    if fp8_c is None or bf16_c is None:
        return words
    if fp8_c < bf16_c:
        return (f"{words}; compiled blocks fuse the casts and make FP8 pay: {fp8_c:.3g} s "
                f"against bf16's {bf16_c:.3g} s (--stack compiled here, train --compile)")
    return (f"{words}; compiled blocks (--stack compiled here, train --compile) do not make it "
            f"pay on this model either: {fp8_c:.3g} s against bf16's {bf16_c:.3g} s")
