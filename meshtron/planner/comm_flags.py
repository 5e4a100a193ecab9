"""The data-parallel traffic flags (gradient compression, DiLoCo) of `meshtron plan` and
`meshtron train`: one table and one parser, torch-free, so that `plan` takes the flags its own
compression note suggests and `train` parses them the same way (meshtron/compress/cli.py
applies them to the runtime's plan).

They are Plan fields (plan.py): a saved plan carries them and the ranks run exactly what was
saved.
"""

from __future__ import annotations

import argparse
from typing import Any

from meshtron.argtypes import positive_int
from meshtron.errors import UserError
from meshtron.planner.plan import COMPRESS_SCOPES, COMPRESSIONS

# flag -> (Plan field, argparse type, help)
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--grad-compression": ("grad_compression", str,
                           f"data-parallel gradient traffic: {' | '.join(COMPRESSIONS)} "
                           "(int8: block-wise absmax with error feedback, summed in fp32)"),
    "--grad-compression-block": ("grad_compression_block", positive_int,
                                 "elements per int8 block (one fp32 scale each; default 256)"),
    "--compress-scope": ("compress_scope", str,
                         "all | inter_node: compress every hop, or only between nodes "
                         "(fp32 inside a node)"),
    "--ranks-per-node": ("ranks_per_node", positive_int,
                         "node size for --compress-scope inter_node and --snapshot-every "
                         "(default: local ranks)"),
    "--diloco": ("diloco", int, "DiLoCo: inner steps H each data-parallel replica takes alone "
                                "between syncs (0: off)"),
    "--outer-lr": ("outer_lr", float, "DiLoCo outer SGD learning rate (default: 1.0, i.e. "
                                      "parameter averaging, below H=500; the paper's 0.7 from "
                                      "there)"),
    "--outer-momentum": ("outer_momentum", float,
                         "DiLoCo outer Nesterov momentum (default: 0 below H=500; the paper's "
                         "0.9 from there)"),
}


def add_arguments(group) -> None:
    """The flags, in an argparse group (dest = the Plan field, prefixed)."""
    for flag, (name, typ, text) in FLAGS.items():
        choices = None
        if name == "grad_compression":
            choices = list(COMPRESSIONS)
        elif name == "compress_scope":
            choices = list(COMPRESS_SCOPES)
        group.add_argument(flag, dest=f"comm__{name}", type=typ, choices=choices,
                           metavar=None if choices else typ.__name__.upper().replace(
                               "POSITIVE_", ""), help=text)


def requested(args: argparse.Namespace) -> dict[str, Any]:
    """The Plan fields the flags set (flags not given are absent)."""
    out = {}
    for name, *_ in FLAGS.values():
        value = getattr(args, f"comm__{name}", None)
        if value is not None:
            out[name] = value
    return out


def search_knobs(comm: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """Knobs for the planner's search: as given. DiLoCo replicas step alone: the search keeps
    its plans to ZeRO-0 (full replicas) and, where a stack on FSDP spans nodes, ZeRO-2/3 with
    node-aligned replicas (HSDP: SearchSpace.zeros and replicates); a fixed stage or replica
    count is the plan rules' to judge."""
    return knobs


def refuse_unread(comm: dict[str, Any]) -> None:
    """A flag that only tunes another one, given without it, changes nothing: refused in one
    line (`--outer-lr 0.5` without --diloco trained and priced as without it, as
    `--compress-scope inter_node` without --grad-compression is refused by the plan rules).
    For a searched plan; a saved one's fields are restated, not set (compress/cli.py apply)."""
    for name in ("outer_lr", "outer_momentum"):
        if name in comm and not comm.get("diloco"):
            raise UserError(f"--{name.replace('_', '-')}={comm[name]}: only with --diloco H > 0 "
                            "(DiLoCo's outer step is all that reads it)")
    block = comm.get("grad_compression_block")
    if block is not None and comm.get("grad_compression") != "int8":
        raise UserError(f"--grad-compression-block={block}: only with --grad-compression int8 "
                        "(the size of its absmax blocks)")
