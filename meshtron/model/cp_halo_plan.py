"""Context parallelism's sliding-window halos in host integers: which rows of K/V every rank
needs from which other rank, and when fetching them pays over gathering the whole sequence.
Torch-free: the runtime (parallel/cp_halo.py) and the planner (planner/compute_core.py,
planner/memory_acts.py) read the same rule and the same row counts from here.

Layout (parallel/context.py): the sequence of `seq` rows is cut into 2*cp chunks of
c = seq / 2cp rows; rank r holds chunks a = r and b = 2cp-1-r, in that order, as its 2c local
rows. A sliding block's query at position p sees the keys p - h .. p, h = window - 1, so the
queries of chunk j need the rows [max(0, jc - h), (j+1)c): their own chunk and the h rows
before it, which for h > c lie in several chunks j-k .. j-1 held by several ranks (the zigzag
placement: chunk i is on rank i for i < cp, on rank 2cp-1-i after).

A rank lays its keys out once, in global order, without duplicates: the union of its two
chunks' ranges (`HaloPlan.keys`). Where chunk b's halo reaches chunk a's rows, or chunk a
itself (rank cp-1, whose chunk b = cp follows its chunk a directly; any rank once h is long
enough), those rows appear once, and rows it holds itself are never sent. Every other row
of the union comes from the rank holding it, in one all_to_all whose split sizes every rank
computes from (seq, cp, rank, window) alone (`halo_plan`): no host sync, and each needed row
crosses the network once per receiving rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshtron.intervals import merge_intervals


def chunk_holder(chunk: int, cp: int) -> int:
    """The cp rank holding global chunk `chunk` (of 2*cp)."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The global chunks (a, b) of `rank`, in its local order."""
    return rank, 2 * cp - 1 - rank


def local_row(pos: int, c: int, cp: int, rank: int) -> int:
    """The local row of global position `pos` on the rank holding it (`rank`): chunk a's rows
    first, then chunk b's."""
    a, b = rank_chunks(cp, rank)
    chunk = pos // c
    assert chunk in (a, b), (pos, c, cp, rank)
    return pos - a * c if chunk == a else c + pos - b * c


@dataclass(frozen=True)
class HaloPlan:
    """One rank's halo exchange and key layout (`halo_plan`)."""

    rank: int
    cp: int
    c: int
    """Rows per chunk (seq / 2cp)."""
    halo: int
    """window - 1: the rows before a query that its band reaches."""
    keys: tuple[tuple[int, int], ...]
    """Global [lo, hi) intervals, sorted and disjoint, of the keys this rank lays out (in this
    order, without duplicates): the union of [max(0, jc - halo), (j+1)c) over its chunks j."""
    pieces: tuple[tuple[int, int, int], ...]
    """(source rank, lo, hi): `keys` cut at chunk borders, in global order; source == rank:
    the rank's own rows, read locally."""
    send: tuple[tuple[int, int, int], ...]
    """(destination rank, lo, hi): the rows of this rank's chunks it sends, by destination
    rank, then in global order (the order of the destination's `pieces`)."""
    send_sizes: tuple[int, ...]
    """Rows sent to each rank (0 to itself)."""
    recv_sizes: tuple[int, ...]
    """Rows received from each rank (0 from itself)."""

    def key_rows(self) -> int:
        """Rows of the key layout: the rank's own 2c and the halo rows it lays out."""
        return sum(hi - lo for lo, hi in self.keys)

    def received(self) -> int:
        """Rows this rank receives from the others."""
        return sum(self.recv_sizes)

    def key_offset(self, pos: int) -> int:
        """The row of global position `pos` in the key layout."""
        before = 0
        for lo, hi in self.keys:
            if lo <= pos < hi:
                return before + pos - lo
            before += hi - lo
        raise ValueError(f"position {pos} is not among rank {self.rank}'s keys {self.keys}")

    def chunk_keys(self, i: int) -> tuple[int, int, int]:
        """(first key row, key rows, halo rows before its first query) of local chunk i (0: a,
        1: b): its queries' keys are contiguous in the layout."""
        chunk = rank_chunks(self.cp, self.rank)[i]
        first = max(0, chunk * self.c - self.halo)
        return self.key_offset(first), (chunk + 1) * self.c - first, chunk * self.c - first

    def recv_pieces(self) -> tuple[tuple[int, int, int], ...]:
        """(source rank, offset in the received rows, rows) per piece of `pieces`:
        the received buffer holds the sources in rank order, each source's rows in global
        order; a piece from this rank itself has source == rank and an offset in its local
        rows instead."""
        start = [sum(self.recv_sizes[:s]) for s in range(self.cp)]
        out = []
        for src, lo, hi in self.pieces:
            if src == self.rank:
                out.append((src, local_row(lo, self.c, self.cp, self.rank), hi - lo))
            else:
                out.append((src, start[src], hi - lo))
                start[src] += hi - lo
        return tuple(out)


def _needed(seq: int, cp: int, rank: int, halo: int) -> tuple[tuple[int, int, int], ...]:
    """(source, lo, hi) pieces of rank `rank`'s key layout."""
    c = seq // (2 * cp)
    keys = tuple(merge_intervals([(max(0, j * c - halo), (j + 1) * c)
                                 for j in rank_chunks(cp, rank)]))
    pieces = []
    for lo, hi in keys:
        for chunk in range(lo // c, (hi - 1) // c + 1):
            pieces.append((chunk_holder(chunk, cp), max(lo, chunk * c), min(hi, (chunk + 1) * c)))
    return tuple(pieces)


@lru_cache(maxsize=4096)
def halo_plan(seq: int, cp: int, rank: int, window: int) -> HaloPlan:
    """Rank `rank`'s halo exchange for a band of `window` keys over `seq` rows on `cp` ranks
    (seq a multiple of 2cp): host integers only, the same on every rank."""
    c, halo = seq // (2 * cp), window - 1
    mine = _needed(seq, cp, rank, halo)
    send = [(dst, lo, hi) for dst in range(cp) if dst != rank
            for src, lo, hi in _needed(seq, cp, dst, halo) if src == rank]
    send_sizes = [0] * cp
    for dst, lo, hi in send:
        send_sizes[dst] += hi - lo
    recv_sizes = [0] * cp
    for src, lo, hi in mine:
        if src != rank:
            recv_sizes[src] += hi - lo
    keys = tuple(merge_intervals([(lo, hi) for _, lo, hi in mine]))
    return HaloPlan(rank, cp, c, halo, keys, mine, tuple(send), tuple(send_sizes),
                    tuple(recv_sizes))


@lru_cache(maxsize=4096)
def halo_traffic(seq: int, cp: int, window: int) -> tuple[int, int]:
    """(rows moved, key rows kept) of the fullest cp rank under the halo exchange: the most
    rows any rank sends or receives in the all_to_all, and the most K/V rows a rank's sliding
    blocks lay out and keep for backward.

    Moved counts sends as well as receives: NCCL's all_to_all is each rank's sends and
    receives at once (grouped ncclSend/ncclRecv over full-duplex links), so a rank's part
    takes max(sent, received) bytes of its link and the collective ends with the busiest
    rank; backward returns the gradients the other way, so forward's busiest sender is
    backward's busiest receiver. The two differ: once the window passes half the sequence
    rank cp-1 (chunks cp-1 and cp, in the middle) sends both its chunks to every other rank
    (16k tokens, cp 8, w 8194: 14336 rows sent, the most received 11264), and at odd cp
    a rank can send 4/3 of the most any rank receives (96k tokens, cp 3, w 49152: 65535
    sent, 49152 received)."""
    sent, received, kept = [0] * cp, [0] * cp, 0
    for rank in range(cp):  # each rank's pieces only (halo_plan adds every rank's sends)
        pieces = _needed(seq, cp, rank, window - 1)
        kept = max(kept, sum(hi - lo for _, lo, hi in pieces))
        for src, lo, hi in pieces:
            if src != rank:
                received[rank] += hi - lo
                sent[src] += hi - lo
    return max(sent + received), kept


def halo_rows(seq: int, cp: int, window: int) -> int | None:
    """Rows before a query that a sliding block's band reaches (window - 1), where fetching
    them (the halo exchange) pays; None where the whole sequence is gathered instead.

    Why this threshold: the gather moves (cp-1)/cp x seq rows of K and V into and out of
    every rank and keeps seq rows per layer for backward. The halo never moves more: a rank
    sends each of its 2c rows at most once to each of the cp-1 others and receives at most
    the seq - 2c rows it does not hold (`halo_traffic`: the busiest rank's sends or
    receives, both bytes in the same dtype through the same links); it keeps its key rows,
    its own 2c and those it receives, at most seq (the union of what its queries see, without
    duplicates). So the halo pays while the fullest rank keeps fewer rows than the sequence,
    i.e. receives fewer than the gather brings (e.g. 32k tokens, cp 8, w 4096: 8190 rows
    moved against 28672 gathered; 12286 kept, 32768). As the window approaches the
    sequence the union covers it and the halo moves what the gather moves: then the gather
    (NCCL's ring all-gather and its reduce-scatter, tuned at bus bandwidth; no per-piece
    copies) runs instead. The compute is the same either way (both skip the tiles outside
    the band)."""
    if cp <= 1 or window < 1 or seq % (2 * cp):
        return None
    _, kept = halo_traffic(seq, cp, window)
    return window - 1 if kept < seq else None
