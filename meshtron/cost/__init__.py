"""`meshtron cost`: what a training run costs in days, GPU-hours, energy and money, with the
expected overhead of failures and spot preemptions and a Monte Carlo of the whole run.

Modules: catalogue (prices and power per GPU type, with sources), montecarlo (numpy simulation
of a run's failures and preemptions), model (expected figures via meshtron.reliability, the
summary and the recommendation), cli.
"""
