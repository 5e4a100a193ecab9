"""Fixed-length windows over a token stream and the deterministic data-parallel sampler.

`TokenDataset` cuts one flat token array into windows of `seq_len + 1` tokens with stride
`seq_len` (window i starts at token i*seq_len; its last token is the first of window i+1), so every
token is a target exactly once. inputs = window[:-1], targets = window[1:].

`DistributedBatchSampler` defines one infinite stream of window indices: epoch e is a permutation
of all windows keyed by (seed, e), epochs follow each other, and global step k takes the
`global_batch` stream entries starting at `k * global_batch` (a step may straddle two epochs; no
window is dropped). Data-parallel rank r takes rows `[r*B/dp, (r+1)*B/dp)` of that global batch, so
concatenating the ranks' batches in rank order gives exactly the single-process batch, for any dp.

The permutation uses a counter-based hash (splitmix64) and a stable sort, in plain uint64
arithmetic: the same on every machine, OS and numpy version, with no RNG state to carry. The
position is a small dict (`state_dict()`); loading it resumes with exactly the same batches, also
under a different dp size.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from meshtron.errors import UserError

# torch is imported by the first batch made, not here: the windows, the sampler and the
# held-out picks are numpy, so `build_data` (and `meshtron train --nproc N`'s launcher, which
# checks the data before any rank starts) runs without importing torch.
if TYPE_CHECKING:
    import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

if TYPE_CHECKING:
    Batch = tuple[torch.Tensor, torch.Tensor]
else:
    Batch = tuple
"""(inputs, targets): two int64 tensors of shape [rows, seq_len]."""


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"{name}={value!r}: must be {what}")
    return int(value)


def check_dp(global_batch: int, dp_rank: int, dp_size: int) -> int:
    """Validate the data-parallel layout; returns the per-rank batch (rows)."""
    global_batch = _check_int("data.global_batch", global_batch)
    dp_size = _check_int("dp_size", dp_size)
    dp_rank = _check_int("dp_rank", dp_rank, minimum=0)
    if dp_rank >= dp_size:
        raise UserError(f"dp_rank={dp_rank}: must be in 0..{dp_size - 1} (dp_size={dp_size})")
    if global_batch % dp_size:
        raise UserError(
            f"data.global_batch={global_batch}: must be divisible by dp_size={dp_size} "
            "(every data-parallel rank takes an equal slice)")
    return global_batch // dp_size


# ---- permutation ---------------------------------------------------------------------------

def _mix64_scalar(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The order (int64 window indices) in which epoch `epoch` visits `num_windows` windows."""
    base = _mix64_scalar(_mix64_scalar(seed ^ 0x6D65736874726F6E) ^ (epoch * _GOLDEN))
    with np.errstate(over="ignore"):
        counters = np.arange(1, num_windows + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
        keys = _mix64(counters + np.uint64(base))
    return np.argsort(keys, kind="stable").astype(np.int64)


# ---- dataset -------------------------------------------------------------------------------

class TokenDataset:
    """Windows of `seq_len + 1` tokens (stride `seq_len`) over one flat token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, name: str = "train",
                 required: bool = True) -> None:
        """`required`: at least one window (else a UserError); False allows none (a held-out
        split nothing will read)."""
        self.seq_len = _check_int("data.seq_len", seq_len)
        if tokens.ndim != 1:
            raise UserError(f"{name} tokens: expected a flat array, got shape {tokens.shape}")
        self.tokens = tokens
        self.num_windows = (len(tokens) - 1) // self.seq_len if len(tokens) else 0
        if self.num_windows < 1 and required:
            shorter = (f"; or --seq-len {len(tokens) - 1} or less" if len(tokens) > 1 else "")
            raise UserError(
                f"data.seq_len={self.seq_len}: the {name} split holds {len(tokens)} tokens, "
                f"fewer than one window of seq_len+1={self.seq_len + 1}; add data{shorter}")
        self._offsets = np.arange(self.seq_len + 1, dtype=np.int64)

    def __len__(self) -> int:
        return self.num_windows

    def windows(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """[len(indices), seq_len+1] int64 token windows."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_windows):
            raise IndexError(f"window index out of range 0..{self.num_windows - 1}")
        return np.asarray(self.tokens[idx[:, None] * self.seq_len + self._offsets],
                          dtype=np.int64)

    def batch(self, indices: np.ndarray | Sequence[int]) -> Batch:
        """(inputs, targets) LongTensors of shape [len(indices), seq_len]."""
        import torch  # once per step (see the imports above)

        w = torch.from_numpy(self.windows(indices))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# ---- sampler -------------------------------------------------------------------------------

class DistributedBatchSampler:
    """Deterministic, resumable window sampler that knows its data-parallel rank.

    The position is the number of stream entries consumed (`sample`) plus the step counter; a run
    may resume under a different dp size (and even a different global batch: the stream continues
    at the same sample).
    """

    def __init__(self, num_windows: int, global_batch: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        self.num_windows = _check_int("num_windows", num_windows)
        self.local_batch = check_dp(global_batch, dp_rank, dp_size)
        self.global_batch = int(global_batch)
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed = _check_int("data.seed", seed, minimum=0)
        self.step = 0
        self.sample = 0
        self._perms: dict[int, np.ndarray] = {}

    # -- the stream --
    def permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 2:  # a step touches at most two epochs (usually one)
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = epoch_permutation(self.num_windows, self.seed, epoch)
        return perm

    def stream(self, start: int, count: int) -> np.ndarray:
        """Stream entries [start, start+count): window indices, crossing epochs as needed."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(start + filled, self.num_windows)
            take = min(count - filled, self.num_windows - offset)
            out[filled:filled + take] = self.permutation(epoch)[offset:offset + take]
            filled += take
        return out

    def last_step_fields(self) -> dict[str, Any]:
        """The step just read, as its global stream position: the first stream entry of the
        step and a hash of the global batch's window ids (every rank's rows, rank order). An
        elastic run writes them into every metrics record, the proof that a step read the same
        samples on any layout."""
        start = self.sample - self.global_batch
        ids = np.ascontiguousarray(self.stream(start, self.global_batch), dtype="<i8")
        return {"samples_from": int(start),
                "samples_sha": hashlib.sha256(ids.tobytes()).hexdigest()[:16]}

    def global_indices(self, step: int) -> np.ndarray:
        """Window indices of global step `step` (all ranks, rank order), for a constant batch."""
        return self.stream(step * self.global_batch, self.global_batch)

    def local_indices(self, step: int) -> np.ndarray:
        """This rank's rows of `global_indices(step)`."""
        lo = self.dp_rank * self.local_batch
        return self.global_indices(step)[lo:lo + self.local_batch]

    def next_indices(self) -> np.ndarray:
        """This rank's window indices for the current position; advances one step."""
        lo = self.sample + self.dp_rank * self.local_batch
        idx = self.stream(lo, self.local_batch)
        self.sample += self.global_batch
        self.step += 1
        return idx

    @property
    def epoch(self) -> int:
        """The epoch the next step starts in."""
        return self.sample // self.num_windows

    # -- position --
    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "step": self.step,
                "sample": self.sample, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`'s position (its seed wins over the one given at construction)."""
        missing = [k for k in ("seed", "step", "sample", "num_windows") if k not in state]
        if missing:
            raise UserError(f"data state: missing keys {missing} (got {sorted(state)})")
        if int(state["num_windows"]) != self.num_windows:
            raise UserError(
                f"data state: num_windows={state['num_windows']} was saved, this data has "
                f"{self.num_windows} windows (different source, tokenizer or seq_len)")
        self.seed = _check_int("data state seed", state["seed"], minimum=0)
        self.step = _check_int("data state step", state["step"], minimum=0)
        self.sample = _check_int("data state sample", state["sample"], minimum=0)
        self._perms.clear()


# ---- loaders -------------------------------------------------------------------------------

class TrainLoader:
    """Endless iterator of this rank's training batches; resumable via `state_dict()`."""

    def __init__(self, dataset: TokenDataset, sampler: DistributedBatchSampler,
                 tokenizer: Any = None, info: dict[str, Any] | None = None) -> None:
        if sampler.num_windows != dataset.num_windows:
            raise UserError("sampler.num_windows must equal dataset.num_windows")
        self.dataset, self.sampler = dataset, sampler
        self.tokenizer = tokenizer
        self.info = dict(info or {})

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    @property
    def local_batch(self) -> int:
        return self.sampler.local_batch

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.tokenizer, "vocab_size", self.info.get("vocab_size"))

    @property
    def step(self) -> int:
        return self.sampler.step

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def next_batch(self) -> Batch:
        """This rank's (inputs, targets), [global_batch/dp_size, seq_len] each; advances."""
        return self.dataset.batch(self.sampler.next_indices())

    def batch_at(self, step: int) -> Batch:
        """This rank's batch of step `step` (constant global batch from step 0); no advance."""
        return self.dataset.batch(self.sampler.local_indices(step))

    def global_batch_at(self, step: int) -> Batch:
        """All ranks' rows of step `step`, in rank order; no advance."""
        return self.dataset.batch(self.sampler.global_indices(step))

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class EvalBatches:
    """A fixed, deterministic list of held-out batches, sliced by data-parallel rank.

    `num_batches * global_batch` windows are picked evenly spread over the held-out windows (in
    order; windows repeat only when the held-out split is smaller than that). Batch j's global rows
    are picks [j*B, (j+1)*B); rank r gets rows [r*B/dp, (r+1)*B/dp). Re-iterable.
    """

    def __init__(self, dataset: TokenDataset, global_batch: int, num_batches: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        self.local_batch = check_dp(global_batch, dp_rank, dp_size)
        self.num_batches = _check_int("data.eval_batches", num_batches, minimum=0)
        self.dataset = dataset
        self.global_batch, self.dp_rank, self.dp_size = int(global_batch), dp_rank, dp_size
        total = self.num_batches * self.global_batch
        n = dataset.num_windows
        if total <= n:
            picks = (np.arange(total, dtype=np.int64) * n) // max(total, 1)
        else:
            picks = np.arange(total, dtype=np.int64) % n
        self._picks = picks.reshape(self.num_batches, self.global_batch)

    def __len__(self) -> int:
        return self.num_batches

    def global_indices(self, j: int) -> np.ndarray:
        return self._picks[j]

    def __getitem__(self, j: int) -> Batch:
        lo = self.dp_rank * self.local_batch
        return self.dataset.batch(self._picks[j][lo:lo + self.local_batch])

    def global_batch_at(self, j: int) -> Batch:
        return self.dataset.batch(self._picks[j])

    def __iter__(self) -> Iterator[Batch]:
        for j in range(self.num_batches):
            yield self[j]


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int
                        ) -> list[Batch]:
    """Split a rank's batch into micro-batches of `micro_batch` rows (views, in row order).

    The number of micro-batches is the gradient-accumulation count.
    """
    micro_batch = _check_int("data.micro_batch", micro_batch)
    rows = inputs.shape[0]
    if rows % micro_batch:
        raise UserError(
            f"data.micro_batch={micro_batch}: must divide the per-rank batch of {rows} rows "
            "(data.global_batch / dp_size)")
    return [(inputs[i:i + micro_batch], targets[i:i + micro_batch])
            for i in range(0, rows, micro_batch)]
