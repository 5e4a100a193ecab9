"""Published training runs and their runner (moved out of the product package): the planner's
calibration and validation tables. `table` (PublishedRun, predict_published, summary), `runs`
(the rows), `megatron2021` (Narayanan et al. 2021 Table 1 from ../shared/calibration).
`bench/planner_cli_table.py` runs every row through `meshtron plan`."""
