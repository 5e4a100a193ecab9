"""Moved to meshtron.planner.compression (the planner's cost of compression and DiLoCo); kept
as an alias so that existing imports keep working."""

from meshtron.planner.compression import *  # noqa: F401,F403
from meshtron.planner.compression import (  # noqa: F401
    CODEC_BYTES_PER_ELEMENT, OUTER_BYTES_PER_PARAM, changes_dp, dp_time,
    extra_state_bytes, reduce_time, wire_bytes, with_state_bytes)
from meshtron.planner.compression_advice import advice  # noqa: F401
