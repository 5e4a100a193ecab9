"""Keep training through the loss of ranks and nodes: elastic world sizes with re-planning
(elastic.py) and per-step replica fault tolerance (replica.py). The in-memory peer snapshots
a restart restores from are a checkpoint tier (meshtron/checkpoint/snapshot.py)."""
