"""Training: the path from `meshtron train` to the ranks, one module per stage.

    cli.py       flags + run file -> a typed TrainJob (job.py); bad input is a UserError
    launch.py    this process, N local ranks under torchrun, or a rank of an outside world
    planning.py  the plan: saved, or searched for this world with the fixed knobs
    rank.py      one rank: process group, the plan rank 0 resolved, exit codes
    parallel.py  the parallel engine (mesh, parallelize, optimizer) and a rank's run
    loop.py      the loop shared by every engine, and the single-process reference engine
    outputs.py   run folder, summary.json, curves.png, TensorBoard, console lines
    metrics.py   metrics.jsonl, the step clock (one tokens/s definition), progress
    demo.py      `meshtron demo`
"""
