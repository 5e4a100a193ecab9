"""Keep training through the loss of ranks and nodes: elastic world sizes with re-planning
(elastic.py), in-memory peer snapshots (snapshot.py) and per-step replica fault tolerance
(replica.py)."""
