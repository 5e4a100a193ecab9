"""Published training runs and their runner (moved out of the product package): the planner's
calibration and validation tables. `table` (PublishedRun, predict_published, summary, the
clusters of the runs), `runs` (the table: its rows in order, their parts and the relabelling of
rows that steered a choice), `rows_megatron`, `rows_pytorch`, `rows_moe` (the rows per family
of sources), `stacks` (their software stacks as KernelOptions / MemoryOptions), `megatron2021`
(Narayanan et al. 2021 Table 1 from ../shared/calibration). `bench/planner_cli_table.py` runs
every row through `meshtron plan`."""
