"""`h3 matrix`: `h3 generate` for every feasible mode x rank count, side by side in one report.

The seed's matrix: Ulysses and tensor mode at 1, 2, 4, 6 and 8 GPUs, counts above the visible
GPU count skipped. What runs, and in which order:

- Per mode, the 1-rank cell runs first, also when 1 is not among the requested counts: it is the
  baseline of every speedup and the parity reference of the mode (marked `requested: false`).
  Then the other counts, ascending. Every cell is a fresh World (`h3core.generate.run.execute`).
- Skipped (listed with the reason, never run): on CUDA, counts above the visible GPU count; any
  count whose partition `h3core.generate.resolve` rejects (e.g. more ranks than heads). On a CPU
  machine every count runs, as Gloo ranks sharing the cores.
- A cell whose run fails (a rank raises or dies) records the error line; the others still run.
  `check_matrix` then raises `CheckFailed`, so the command exits non-zero after its report.
- Each cell writes its own `report.json` (and preview, and latents unless not saved) in
  `<output>/<mode>-<count>/`; `matrix.json` and `matrix.md` are rewritten after every cell,
  `matrix.png` when the matrix is complete. All of it is staged and published as one folder
  (`h3core.reports.outputs`): a matrix interrupted with Ctrl-C publishes the cells it finished (its
  `matrix.json` says `complete: false`); one that fails otherwise leaves nothing.

Figures per cell: sampling time (all steps, slowest rank); step time = the median step after the
first (the first step of a fresh process carries one-time warm-up: lazy kernel and allocator
set-up; the 1-rank cells run in this process, warm after the first of them, so including it
would favour them unevenly); with a single step there is no step after the warm-up: step time,
speedup and efficiency are then not shown, and the report says why (`scaling_note`);
speedup = the mode's 1-rank step time / this cell's; efficiency =
speedup / count; peak memory and resident weight bytes of the
largest rank, bytes sent through collectives by all ranks, and latent parity vs one rank.

CPU honesty: the ranks of a CPU cell share the machine's cores (`cpu_threads_per_rank(count)`
intra-op threads each), so CPU speedups mostly measure how the cores are shared, not scaling.
CPU GEMM and attention kernels choose their blocking by thread count, so two CPU runs are bit
comparable only at equal thread counts: a cell is compared with one rank of the same mode run at
the cell's per-rank thread count. That is the 1-rank cell itself when the counts agree, else an
extra 1-rank reference run in this process (cached per mode and thread count). The parity figure
then isolates the distribution (Ulysses: bitwise; tensor: summation order), not the threading.
On CUDA the reference is always the 1-rank cell.

The package: `request` (what runs: counts, modes, the template request; flag > variable > default),
`cells` (each cell resolved or skipped before anything runs), `run` (the cells in order, the one
progress bar, parity references), `summary` (the figures of a cell and the verdict), `report` (the
schema, `matrix.json`), `files` (matrix.json, .md and .png staged in the output folder) and
`render` (the tables, the Markdown and the chart, from a report only).
"""
