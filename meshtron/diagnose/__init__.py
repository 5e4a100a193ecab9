"""`meshtron doctor`: read what a run left in its folder, after the fact, and explain it.

The verdict on a failed or frozen run (`analyze.py`, from the dumps in RUN_DIR/trace that
`trace.py` reads), the timeline of a healthy one with the planner's predicted pipeline bubble
on the cluster the trainer picks on this node (`timeline_view.py`), and NCCL debug logs
(`nccl.py`). What the ranks record while they run is `meshtron.doctor`'s, below the trainer
that starts it; this package sits above the trainer because it asks for the cluster the
trainer would plan on.
"""
