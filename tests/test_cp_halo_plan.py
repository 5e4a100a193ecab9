"""Context parallelism's halo plan (meshtron/model/cp_halo_plan.py) against a brute-force
reference, torch-free: for many (seq, cp, window) every rank's data is its global positions in
its local order (chunk a, then chunk b); the all_to_all the plan describes is simulated row by
row (each rank's send buffer cut by its send sizes, each receiver's buffer the sources' parts
in rank order) and the key layout assembled from it must be exactly the positions the rank's
queries see, each once, ascending; each chunk's keys a contiguous run of it; the split sizes
must agree between sender and receiver; `halo_rows` must be the rule counted position by
position; and the planner must use the same rule and row counts.
"""

from __future__ import annotations

import pytest

from meshtron.model.cp_halo_plan import halo_plan, halo_rows, halo_traffic

CASES = [(seq, cp, window) for cp in (2, 3, 4, 5, 8) for seq in (2 * cp * 3, 2 * cp * 8)
         for window in range(1, seq + 2)]


def _own(seq: int, cp: int, r: int) -> list[int]:
    c = seq // (2 * cp)
    return list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))


def _seen(seq: int, cp: int, r: int, window: int) -> set[int]:
    """Every key position a query of rank r reaches (its own included)."""
    return {p for q in _own(seq, cp, r) for p in range(max(0, q - window + 1), q + 1)}


def _simulate(seq: int, cp: int, window: int) -> list[list[int]]:
    """Each rank's key layout (global positions) after the exchange the plans describe."""
    plans = [halo_plan(seq, cp, r, window) for r in range(cp)]
    data = [_own(seq, cp, r) for r in range(cp)]
    outbox = []
    for r, plan in enumerate(plans):
        buf = [p for _, lo, hi in plan.send for p in range(lo, hi)]
        assert buf == [data[r][_local(data[r], p)] for p in buf]  # rows this rank holds
        parts, at = [], 0
        for n in plan.send_sizes:
            parts.append(buf[at:at + n])
            at += n
        assert at == len(buf)
        outbox.append(parts)
    layouts = []
    for r, plan in enumerate(plans):
        got = [p for s in range(cp) for p in outbox[s][r]]
        assert [len(outbox[s][r]) for s in range(cp)] == list(plan.recv_sizes)
        keys = []
        for src, at, n in plan.recv_pieces():
            keys += (data[r] if src == r else got)[at:at + n]
        layouts.append(keys)
    return layouts


def _local(rows: list[int], pos: int) -> int:
    return rows.index(pos)


@pytest.mark.parametrize("cp", [2, 3, 4, 5, 8])
def test_halo_exchange_lays_out_exactly_the_keys_each_rank_sees(cp):
    for seq, cp_, window in CASES:
        if cp_ != cp:
            continue
        c = seq // (2 * cp)
        layouts = _simulate(seq, cp, window)
        for r, keys in enumerate(layouts):
            plan = halo_plan(seq, cp, r, window)
            want = sorted(_seen(seq, cp, r, window))
            assert keys == want, (seq, cp, window, r)
            assert plan.key_rows() == len(want)
            assert plan.received() == len(set(want) - set(_own(seq, cp, r)))
            assert plan.send_sizes[r] == plan.recv_sizes[r] == 0  # nothing sent to itself
            for i, chunk in enumerate((r, 2 * cp - 1 - r)):
                first, rows, before = plan.chunk_keys(i)
                assert before == min(window - 1, chunk * c)
                assert keys[first:first + rows] == list(range(chunk * c - before, (chunk + 1) * c))
        for s in range(cp):  # the sender's split sizes are the receiver's
            for d in range(cp):
                assert (halo_plan(seq, cp, s, window).send_sizes[d]
                        == halo_plan(seq, cp, d, window).recv_sizes[s])


def _sent(seq: int, cp: int, s: int, window: int) -> int:
    """Rows rank s sends: each of its rows once to every other rank whose queries see it."""
    return sum(len(_seen(seq, cp, d, window) & set(_own(seq, cp, s))) for d in range(cp)
               if d != s)


def test_halo_rows_is_the_rule_counted_position_by_position():
    """The halo while the fullest rank receives fewer rows than the gather's (cp-1)/cp x seq
    (keeps fewer than the sequence); its key rows never exceed the sequence (no duplicates);
    the rows it moves (the busiest rank's sends or receives) never exceed the gather's."""
    for seq, cp, window in CASES:
        received = max(len(_seen(seq, cp, r, window) - set(_own(seq, cp, r))) for r in range(cp))
        sent = max(_sent(seq, cp, r, window) for r in range(cp))
        kept = max(len(_seen(seq, cp, r, window)) for r in range(cp))
        assert halo_traffic(seq, cp, window) == (max(sent, received), kept), (seq, cp, window)
        assert kept <= seq and max(sent, received) <= (cp - 1) * seq // cp
        want = window - 1 if received < (cp - 1) * seq // cp else None
        assert halo_rows(seq, cp, window) == want, (seq, cp, window)
    # a window within a chunk always pays; every row but the rank's own is never cheaper
    assert halo_rows(32768, 8, 2049) == 2048 and halo_rows(32768, 8, 4096) == 4095
    assert halo_rows(32768, 8, 32768) is None and halo_rows(32, 1, 3) is None


def test_halo_traffic_counts_the_busiest_sender():
    """An all_to_all takes the busiest rank's sends or receives (NCCL's grouped send/recv over
    full-duplex links), and the planner prices the halo with `halo_traffic`'s rows: counting
    receives only, it priced 16k tokens at cp 8 with a window of 8194 at 11264 rows while
    rank 7 (chunks 7 and 8, in the middle) sends both its chunks to all 7 others, 14336; and
    at cp 3, 96k tokens, a window of 49152, 49152 rows while rank 2 sends 65535."""
    for seq, cp, window, busiest, sender in ((16384, 8, 8194, 14336, 7),
                                             (98304, 3, 49152, 65535, 2)):
        plans = [halo_plan(seq, cp, r, window) for r in range(cp)]
        assert sum(plans[sender].send_sizes) == busiest
        assert max(p.received() for p in plans) < busiest
        assert halo_traffic(seq, cp, window)[0] == busiest
        assert halo_rows(seq, cp, window) == window - 1  # still the halo: it keeps less
    # the planner's exposed exchange follows: rows over the seq/cp local rows
    from meshtron.model.spec import PRESETS
    from meshtron.planner.compute_core import cp_halo
    from meshtron.planner.kernel_options import KernelOptions

    spec = PRESETS["debug"].replace(sliding_window=8194, window_every=0)
    assert cp_halo(spec, KernelOptions(), 16384, 8) == (1.0, 14336 / 2048)


def test_planner_prices_the_runtime_rule():
    """The planner's halo (planner/compute_core.py `cp_halo_rows`, `cp_halo`;
    memory_acts.py `gathered_kv_bytes`) reads the same rule and rows as the runtime."""
    from meshtron.model.spec import PRESETS
    from meshtron.planner.compute_core import cp_halo, cp_halo_rows
    from meshtron.planner.kernel_options import KernelOptions

    spec = PRESETS["debug"].replace(sliding_window=13, window_every=2)
    for cp in (2, 4):
        assert cp_halo_rows(spec, 32, cp) == halo_rows(32, cp, 13)
    share, rows = cp_halo(spec, KernelOptions(), 32, 4)
    assert share == 0.5 and rows == halo_traffic(32, 4, 13)[0] / (32 / 4)
    assert cp_halo_rows(spec, 32, 1) is None and cp_halo_rows(spec, 12, 2) is None


def test_selective_recompute_keeps_only_the_received_rows():
    """Without recomputation a sliding block keeps its key layout (the fullest rank's key rows);
    under selective recomputation, which keeps the outputs of matmuls and collectives only
    (parallel/recompute.py; what the runtime keeps is measured in tests/test_cp_halo_odd.py),
    only the all_to_all's received rows (its own K/V are the projections' outputs, counted with
    the activations): priced as the key rows before, 18430 instead of 2046 rows at 128k, cp 8,
    window 1024. The gather keeps the sequence either way."""
    from meshtron.model.spec import PRESETS
    from meshtron.planner import memory
    from meshtron.planner.kernel_options import KernelOptions
    from meshtron.planner.memory_acts import gathered_kv_bytes

    opts = KernelOptions()
    mem = memory.options_for(opts)
    base = PRESETS["llama3-8b"]
    per_row = 2.0 * base.kv_dim * mem.compute_bytes  # K and V of one position
    for seq, cp, window in ((131072, 8, 1024), (32768, 8, 4096), (96, 3, 20), (32, 2, 12)):
        spec = base.replace(sliding_window=window, window_every=0)  # every block slides
        received = max(halo_plan(seq, cp, r, window).received() for r in range(cp))
        kept = halo_traffic(seq, cp, window)[1]
        assert gathered_kv_bytes(spec, 1, 1, seq, cp, "none", opts, mem) == kept * per_row
        assert (gathered_kv_bytes(spec, 1, 1, seq, cp, "selective", opts, mem)
                == received * per_row), (seq, cp, window)
        assert gathered_kv_bytes(base, 1, 1, seq, cp, "selective", opts, mem) == seq * per_row
    assert max(halo_plan(131072, 8, r, 1024).received() for r in range(8)) == 2046
