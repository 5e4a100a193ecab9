"""`meshtron rehearse`: one rank of a plan run alone at its real shapes (fake process group;
fake tensors on CPU, real ones on a GPU), its peak memory and step time next to the
planner's. `rank.py` builds the rank and `step.py` runs its step (torch; `pipeline_step.py`
a pipelined rank's stages, `memory.py` the tracker), `compare.py` puts the planner's
breakdown beside it (torch-free), `cli.py` is the command."""
