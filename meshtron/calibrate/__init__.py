"""`meshtron calibrate`: measure this machine over the real backend and write a cluster file.

The measurements live in `meshtron.calibrate.measure` (imports torch); the CLI in `cli.py`.
"""
