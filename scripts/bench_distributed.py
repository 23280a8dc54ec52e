#!/usr/bin/env python3
"""What the distributed layer costs, measured side by side in one run on this machine.

1. World size 1: the distributed pipeline (Ulysses and tensor mode applied, group of one) vs
   the plain pipeline (`RankPipeline.unparallelized`: the model loaded, `parallelize` never
   called) on the same inputs -> overhead ratio (target <= 1.05).
2. 2 ranks vs 1 rank (Gloo on the CPU, or NCCL on 2 GPUs) -> speedup, at equal intra-op threads
   per rank (on a 2-core machine: 2 ranks x 1 thread vs 1 rank x 1 thread).
3. Why a mode scales as it does: one more profiled 2-rank run per mode prints the bytes each rank
   sends per step (per collective kind) and where its step goes (h3core.generate.profile).
4. The physical limit of 2 vs 1 on this machine: two processes running the same single-threaded
   GEMM loop at once vs one alone (CPU only). Two vCPUs that are SMT siblings, or a host that
   throttles, give less than 2x whatever h3 does; each speedup is also shown as a share of it.
   The ceiling is measured inside the same rotation as the variants (one measurement per round),
   so that it sees the load they see, not a load of another minute.

All five variants (plain, ulysses x1, tensor x1, ulysses x2, tensor x2) and the ceiling alternate in a
rotating order, both Worlds kept up, so that drift on a shared machine hits all
variants alike; each figure is the median of --repeat runs of the steady step time. The default preset,
wide-1k, has enough compute per step (~2 s per step on one CPU thread) for scaling to show; narrow's 194
tokens measure overheads only.

    python scripts/bench_distributed.py --preset wide-1k --steps 4 --repeat 5 [--decoded-weights off]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

from rich.console import Console
from rich.table import Table

from h3core.generate.pipeline import RankPipeline, rank_generate
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes import Mode
from h3core.reports.units import format_bytes
from h3core.runtime.device import cpu_threads, cpu_threads_per_rank, resolve_device
from h3core.runtime.world import World


def step_seconds(world: World, run, load=RankPipeline.load) -> float:  # type: ignore[no-untyped-def]
    """The run's steady step time: per step the slowest rank, then the median of the steps after
    the first (the first carries one-time warm-up), as `h3 matrix` counts it. `load` builds each
    rank's pipeline (the baseline: `RankPipeline.unparallelized`)."""
    outcomes = world.run(rank_generate, run, load=load)
    slowest = [max(o.step_seconds[i] for o in outcomes) for i in range(len(outcomes[0].step_seconds))]
    return statistics.median(slowest[1:] or slowest)


GEMM_SIZE, GEMM_REPS = 768, 60


def _gemm_loop(barrier, results, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE)
    for _ in range(3):
        a @ a  # warm-up
    barrier.wait()
    start = time.perf_counter()
    for _ in range(GEMM_REPS):
        a @ a
    results.put(time.perf_counter() - start)


def _gemm_wall(processes: int, threads: int) -> float:
    """Seconds until `processes` GEMM loops started together have all finished."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_gemm_loop, args=(barrier, results, threads)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    seconds = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return max(seconds)


def gemm_ceiling(processes: int, threads: int) -> float:
    """How much more GEMM work `processes` processes finish per second than one (one measurement): the scaling ceiling."""
    return processes * _gemm_wall(1, threads) / _gemm_wall(processes, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="wide-1k")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--decoded-weights", default="auto", choices=("auto", "on", "off"), help="as h3 generate's (off: decode every NVFP4 weight every forward)")
    parser.add_argument("--against-decoding", action="store_true",
                        help="also run each mode at 1 and 2 ranks with --decoded-weights off, in the same rotation")
    args = parser.parse_args()
    device = resolve_device(args.device)
    console = Console()

    def request(mode: Mode, world_size: int, profile: bool = False, decoded: str = args.decoded_weights):
        return resolve(GenerateRequest(preset=args.preset, steps=args.steps, mode=mode, world_size=world_size, device=device, profile=profile,
                                       decoded_weights=decoded))

    one = {mode: request(mode, 1) for mode in Mode}
    two = {mode: request(mode, 2) for mode in Mode}
    # Both Worlds stay up (idle workers cost nothing) so that every variant alternates with every
    # other: drift on a shared machine hits them alike. One-rank variants run at the 2-rank per-rank
    # thread count, so that 1 vs 2 ranks compares equal cores per rank on the CPU.
    with World(1, device) as lone, World(2, device) as pair, cpu_threads(cpu_threads_per_rank(2)):
        variants = [
            ("plain", lone, one[Mode.ULYSSES], RankPipeline.unparallelized), ("ulysses x1", lone, one[Mode.ULYSSES], RankPipeline.load),
            ("tensor x1", lone, one[Mode.TENSOR], RankPipeline.load), ("ulysses x2", pair, two[Mode.ULYSSES], RankPipeline.load),
            ("tensor x2", pair, two[Mode.TENSOR], RankPipeline.load),
        ]
        if args.against_decoding:  # the same runs decoding every NVFP4 weight on every forward
            variants += [(f"{mode.value} x{n} decoding", world, request(mode, n, decoded="off"), RankPipeline.load)
                         for mode in Mode for n, world in ((1, lone), (2, pair))]
        times: dict[str, list[float]] = {name: [] for name, *_ in variants}
        measures = [(name, times[name], lambda w=world, r=run, ld=load: step_seconds(w, r, ld)) for name, world, run, load in variants]
        threads = cpu_threads_per_rank(2) if device == "cpu" else None
        ceilings: list[float] = []
        if threads:  # the ceiling takes its turn in the rotation like any variant
            measures.append(("ceiling", ceilings, lambda: gemm_ceiling(2, threads)))
        for _, world, run, load in variants:  # warm-up
            step_seconds(world, run, load)
        for i in range(args.repeat):
            k = i % len(measures)
            for _, results, measure in measures[k:] + measures[:k]:  # rotate: no variant always goes first
                results.append(measure())
        profiled = {mode: pair.run(rank_generate, request(mode, 2, profile=True)) for mode in Mode}

    med = {k: statistics.median(v) for k, v in times.items()}
    table = Table(title=f"{args.preset}, {args.steps} steps, {device}, median of {args.repeat} runs of the steady step time (median step after the first, slowest rank)", title_justify="left")
    for col in ("variant", "median s/step", "runs s/step", "ratio"):
        table.add_column(col)
    ratio = {
        "plain": "1.000 (baseline)",
        "ulysses x1": f"{med['ulysses x1'] / med['plain']:.3f} vs plain (overhead)",
        "tensor x1": f"{med['tensor x1'] / med['plain']:.3f} vs plain (overhead)",
        "ulysses x2": f"{med['ulysses x1'] / med['ulysses x2']:.2f}x speedup vs ulysses x1",
        "tensor x2": f"{med['tensor x1'] / med['tensor x2']:.2f}x speedup vs tensor x1",
    }
    for mode in ("ulysses", "tensor"):
        if f"{mode} x1 decoding" in med:
            ratio[f"{mode} x1 decoding"] = f"{med[f'{mode} x1'] / med[f'{mode} x1 decoding']:.3f}: {mode} x1 / this"
            ratio[f"{mode} x2 decoding"] = (f"{med[f'{mode} x1 decoding'] / med[f'{mode} x2 decoding']:.2f}x speedup vs {mode} x1 decoding; "
                                            f"{mode} x2 / this {med[f'{mode} x2'] / med[f'{mode} x2 decoding']:.3f}")
    for name, runs in times.items():
        table.add_row(name, f"{med[name]:.3f}", " ".join(f"{t:.3f}" for t in runs), ratio[name])
    console.print(table)
    console.print(f"1-rank variants ran at {threads} intra-op thread(s), like each of the 2 ranks" if threads else "one GPU per rank")
    if threads:
        console.print(_ceiling_line(times, ceilings), soft_wrap=True)
    for mode, outcomes in profiled.items():
        _explain(console, mode, outcomes, args.steps)


def _ceiling_line(times: dict[str, list[float]], ceilings: list[float]) -> str:
    """The ceiling (median of the rounds) and each mode's share of it: the ratio of the medians, and
    the median of the rounds' own shares (each round's speedup over the ceiling measured beside it)."""
    ceiling = statistics.median(ceilings)
    parts = []
    for label, one_name, two_name in _scaling_pairs(times):
        one, two = times[one_name], times[two_name]
        share = statistics.median(one) / statistics.median(two) / ceiling
        rounds = statistics.median(a / b / c for a, b, c in zip(one, two, ceilings))
        parts.append(f"{label} reached {share:.0%} of it ({rounds:.0%} median of the rounds' own shares)")
    return (f"this machine's ceiling for 2 vs 1 (2 single-thread GEMM loops at once vs one, measured in the same rotation, "
            f"median of {len(ceilings)}: {' '.join(f'{c:.2f}' for c in ceilings)}): {ceiling:.2f}x; " + ", ".join(parts))


def _scaling_pairs(times: dict[str, list[float]]) -> list[tuple[str, str, str]]:
    """(label, 1-rank variant, 2-rank variant) of every mode measured, decoding every forward included."""
    pairs = []
    for mode in ("ulysses", "tensor"):
        for suffix in ("", " decoding"):
            if f"{mode} x1{suffix}" in times:
                pairs.append((f"{mode}{suffix}", f"{mode} x1{suffix}", f"{mode} x2{suffix}"))
    return pairs


def _explain(console: Console, mode: Mode, outcomes, steps: int) -> None:
    """Bytes each rank sent per step by kind, and the profiled split of a step (mean over ranks)."""
    from h3core.generate.profile import RunProfile, shares

    sent = {kind: max(o.comm.kinds[kind].bytes_sent for o in outcomes if kind in o.comm.kinds) / steps for kind in outcomes[0].comm.kinds}
    split = RunProfile.of([o.profile for o in outcomes]).steady_mean
    console.print(
        f"{mode.value} x2, per rank and step: sent "
        + ", ".join(f"{kind} {format_bytes(b)}" for kind, b in sorted(sent.items()) if kind != "broadcast")
        + " · step " + f"{split.get('step', 0):.3f} s = "
        + ", ".join(f"{name} {sec:.3f} s ({share:.0%})" for name, sec, share in shares(split)),
        soft_wrap=True,
    )


if __name__ == "__main__":
    main()
