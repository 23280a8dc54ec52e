"""Parallelism, applied to a finished model from outside (the model file has no parallelism).

- `partition`    the partition contract (DESIGN.md §3): balanced splits of heads, tokens, NVFP4 blocks
- `plan`         `ParallelPlan`: that contract applied to one run, built once, consumed by every rank
- `collectives`  the typed collectives both modes are built from (ragged spans, byte counters)
- `runtime`      `ParallelRuntime`: one rank's view of the plan (group, spans, counters, what it used)
- `ulysses`      Ulysses sequence parallelism (DESIGN.md §4)
- `tensor`       NVFP4 tensor parallelism (DESIGN.md §5)
- `parallelize`  the one entry that applies a plan's mode to a loaded model, in a fixed order
"""
