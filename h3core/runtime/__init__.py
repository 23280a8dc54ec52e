"""Processes and devices: where the ranks of a run live, and what they may use.

- `world`       `World`: spawn ranks or join torchrun's, run tasks on them, stop them all on a fault
- `context`     `RankContext`: what a task sees on one rank (and sub-groups of the first ranks)
- `worker`      the spawned rank's side; `messages` what crosses the pipe (results, errors)
- `faults`      `H3_INJECT_FAULT`: a chosen rank fails at a chosen point (tests)
- `liveness`    heartbeats, and the watch that ends a run whose rank stopped
- `rendezvous`  torchrun's env:// rendezvous, bounded by `H3_RANK_TIMEOUT`
- `device`      device and dtype policy, timing, peak memory (`DeviceMeter`), threads per rank
- `fake_cuda`   what a dry run needs below the model: the no-op CUDA guard, the storage tracker,
                torch's fake process group (nothing patched)
- `cpu_memory`  the CPU ranks' allocator policy
- `limits`      a run's memory need against what the machine has, checked before any rank starts
"""
