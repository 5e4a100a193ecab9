"""`meshtron simulate`: how a run scales with the GPU count (sweep.py: re-plan at every size,
CSV and plots), and a discrete-event simulation of one training step rank by rank (step.py,
with the pipeline schedules' operation orders in schedule.py) that shows what the analytical
planner cannot: slow GPUs and jitter."""
