"""Training loops: the single-process reference (loop.py) and its optimizer, schedule and metrics."""
