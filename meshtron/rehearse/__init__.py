"""`meshtron rehearse`: one rank of a plan run alone at its real shapes (fake process group;
fake tensors on CPU, real ones on a GPU), its peak memory and step time next to the
planner's. `rank.py` runs the rank (torch), `compare.py` puts the planner's breakdown beside
it (torch-free), `cli.py` is the command."""
