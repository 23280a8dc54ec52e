"""Parallelism, applied to a finished model from outside (the model file has no parallelism).

Planning (torch-free: the launcher, `h3 plan`, the memory check):

- `partition`    the partition contract (DESIGN.md §3): balanced splits of heads, tokens, NVFP4 blocks
- `layout`       how a run's ranks form groups (replicas x CFG halves x ranks per sequence)
- `modes`        the modes' names (`Mode`) and planning objects (`MODES`): what each rank holds,
                 its memory and rounding; `modes.tensor_shards` declares what tensor mode splits
- `plan`         `ParallelPlan`: that contract applied to one run, built once, consumed by every rank
- `overlap`      Ulysses overlap (`--ulysses-overlap`): the all-to-alls' head groups, and when auto turns it on

Applying (torch, on every rank):

- `collectives`  the typed collectives both modes are built from (ragged spans, byte counters)
- `runtime`      `ParallelRuntime`: one rank's view of the plan (group, spans, counters, what it used)
- `modes.ulysses`  Ulysses sequence parallelism (DESIGN.md §4): `apply_ulysses`, its attention processor
- `modes.tensor`   NVFP4 tensor parallelism (DESIGN.md §5): `apply_tensor`, its shards and hooks
- `parallelize`  the one entry that applies a plan's mode to a loaded model, in a fixed order
"""
