"""`meshtron calibrate`: measure this machine over the real backend and write a cluster file."""

from meshtron.calibrate.measure import Calibration, calibrate

__all__ = ["Calibration", "calibrate"]
