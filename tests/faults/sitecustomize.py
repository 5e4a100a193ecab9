"""Fault injection for tests/test_train_errors.py (on PYTHONPATH only in those tests' child
processes): with MESHTRON_TEST_BAD_TARGETS_AT=K, the K-th training batch of every rank carries
targets outside the vocabulary, so torch itself raises (IndexError from cross_entropy) in the
middle of a step. Nothing of meshtron's validation sees it: it stands for any bug below the
command line."""

import os

_AT = os.environ.get("MESHTRON_TEST_BAD_TARGETS_AT")

if _AT:
    from meshtron.data.dataset import TrainLoader

    _next_batch = TrainLoader.next_batch
    _calls = [0]

    def next_batch(self):
        inputs, targets = _next_batch(self)
        _calls[0] += 1
        if _calls[0] == int(_AT):
            targets = targets + 10_000
        return inputs, targets

    TrainLoader.next_batch = next_batch

# With MESHTRON_TEST_HANG_AT=K (and MESHTRON_TEST_HANG_RANK=R, default 1): rank R stalls in its
# data loader at its K-th batch (a sleep far past any test's timeout), so its peers wait in the
# step's first collective: the hang `meshtron train --watchdog-timeout` must turn into an exit.
_HANG = os.environ.get("MESHTRON_TEST_HANG_AT")

if _HANG and os.environ.get("RANK") == os.environ.get("MESHTRON_TEST_HANG_RANK", "1"):
    import time

    from meshtron.data.dataset import TrainLoader

    _next = TrainLoader.next_batch
    _seen = [0]

    def load_batch(self):
        _seen[0] += 1
        if _seen[0] == int(_HANG):
            time.sleep(3600)
        return _next(self)

    TrainLoader.next_batch = load_batch

# With MESHTRON_TEST_KILL_AT_COMMIT=1: the process SIGKILLs itself when an export is about to
# commit (the rename of its weights to model.safetensors), after every other file is written.
if os.environ.get("MESHTRON_TEST_KILL_AT_COMMIT"):
    import pathlib
    import signal

    _replace = pathlib.Path.replace

    def replace(self, target):
        if pathlib.Path(target).name == "model.safetensors":
            os.kill(os.getpid(), signal.SIGKILL)
        return _replace(self, target)

    pathlib.Path.replace = replace

# With MESHTRON_TEST_STOP_RANK=R: rank R SIGSTOPs itself as its interpreter starts, before
# anything of meshtron runs (a rank that never joins: its peers wait in the rendezvous).
if os.environ.get("RANK") and os.environ.get("RANK") == os.environ.get("MESHTRON_TEST_STOP_RANK"):
    import signal

    os.kill(os.getpid(), signal.SIGSTOP)
