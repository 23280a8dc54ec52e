#!/usr/bin/env python3
"""NVFP4Linear forward vs a dense F.linear of the same weight, side by side, at H3 shapes.

Each row times, in one run and alternating, a dense `F.linear` (fp32 on the CPU; bf16 on CUDA)
and `NVFP4Linear.forward` on the same weight (the dense one is the NVFP4 weight decoded, so both
compute the same product): N rounds after one warm-up round, each round timing both, in the order
dense, NVFP4, then NVFP4, dense (`h3core.bench.alternate.rounds`), so that load drifting on a shared
machine falls on both. It prints each one's median and the median of the per-round ratios.
The weight is random codes and scales (quantizing 154M elements would dominate the run). Weights
are built under `torch.inference_mode()`, as in the pipeline; each linear is prepared for its path
before timing (on Blackwell: the swizzled scales, counted in the NVFP4 bytes), as the loaders do.

    python scripts/bench_nvfp4_linear.py                    # CPU, 128 tokens, median of 3
    python scripts/bench_nvfp4_linear.py --threads 1          # steadier on a shared CPU
    python scripts/bench_nvfp4_linear.py --device cuda --tokens 4096 --repeat 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from h3core.bench.alternate import alternate, ratios
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import NVFP4Weight, dequantize
from h3core.nvfp4.linear import NVFP4Linear

# MiniMax-H3's block linears: residual 5376, attention 56 x 128 = 7168, SwiGLU 14336 (fc1 = [gate; up]).
H3_SHAPES: dict[str, tuple[int, int]] = {  # name: (out, in)
    "qkv_proj": (3 * 7168, 5376),
    "out_proj": (5376, 7168),
    "fc1": (2 * 14336, 5376),
    "fc2": (5376, 14336),
}


def random_weight(out: int, inp: int, device: torch.device, seed: int) -> NVFP4Weight:
    """Random codes, block scales spread over 2^-4 .. 2^8 (all finite e4m3), a typical global scale."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (out, layout.packed_bytes(inp)), dtype=torch.uint8, generator=gen)
    exponent = torch.randint(-4, 9, (out, layout.scale_columns(inp)), generator=gen).float()
    scale = torch.exp2(exponent).to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, scale, torch.tensor(2e-4)).to(device)


def timed_ms(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], float]:
    """One call of `fn`, timed to device completion, in milliseconds (an arm of `alternate`)."""

    def run() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    return run


def bench_shape(name: str, out: int, inp: int, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    dense_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    weight = random_weight(out, inp, device, seed=out + inp)
    linear = NVFP4Linear(weight)
    linear.prepare()  # the fp4 GEMM's operands, built once as the loaders do (counted in nvfp4_mib)
    dense = dequantize(weight, dense_dtype)  # [out, in]
    x = torch.randn(args.tokens, inp, device=device, dtype=dense_dtype)
    times = alternate({"dense": timed_ms(lambda: F.linear(x, dense), device), "nvfp4": timed_ms(lambda: linear(x), device)}, args.repeat)
    dense_ms, nvfp4_ms = statistics.median(times["dense"]), statistics.median(times["nvfp4"])
    flops = 2 * args.tokens * inp * out
    return {
        "name": name,
        "shape": f"{inp}->{out}",
        "tokens": args.tokens,
        "dense_ms": dense_ms,
        "nvfp4_ms": nvfp4_ms,
        "ratio": statistics.median(ratios(times["nvfp4"], times["dense"])),
        "dense_tflops": flops / dense_ms / 1e9,
        "nvfp4_tflops": flops / nvfp4_ms / 1e9,
        "dense_mib": dense.numel() * dense.element_size() / 2**20,
        "nvfp4_mib": linear.resident_bytes / 2**20,
        "path": linear.path,
        "dense_dtype": str(dense_dtype).removeprefix("torch."),
    }


def print_table(rows: list[dict[str, object]], args: argparse.Namespace, device: torch.device) -> None:
    dtype = rows[0]["dense_dtype"]
    print(f"device {device} | tokens {args.tokens} | median of {args.repeat} alternating rounds after 1 warm-up round "
          f"| torch {torch.__version__} | threads {torch.get_num_threads()}")
    header = (f"{'layer':<10} {'in->out':<12} {'F.linear ' + dtype:>16} {'NVFP4Linear':>12} {'time x':>7} "
              f"{'TFLOP/s dense':>14} {'NVFP4':>7} {'weight ' + dtype:>14} {'NVFP4':>9} {'memory x':>9}  path")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:<10} {r['shape']:<12} {r['dense_ms']:>13.1f} ms {r['nvfp4_ms']:>9.1f} ms "
              f"{r['ratio']:>7.2f} {r['dense_tflops']:>14.2f} {r['nvfp4_tflops']:>7.2f} "
              f"{r['dense_mib']:>10.0f} MiB {r['nvfp4_mib']:>5.0f} MiB "
              f"{r['nvfp4_mib'] / r['dense_mib']:>9.3f}  {r['path']}")
    print("time x = NVFP4Linear / F.linear, the median of the per-round ratios (above 1: slower); memory x = resident NVFP4 bytes / dense weight bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--tokens", type=int, default=128, help="rows of the activation (default 128)")
    parser.add_argument("--repeat", type=int, default=3, help="timed repeats per measurement; the median is shown")
    parser.add_argument("--only", choices=sorted(H3_SHAPES), help="benchmark one layer shape")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice); 1 is steadiest "
                        "on a shared machine, where waking a busy thread pool dominates small kernels")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here")
    if args.tokens < 1 or args.repeat < 1:
        raise SystemExit("--tokens and --repeat must be positive")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes = {args.only: H3_SHAPES[args.only]} if args.only else H3_SHAPES
    with torch.inference_mode():
        rows = [bench_shape(name, out, inp, args, device) for name, (out, inp) in shapes.items()]
    print_table(rows, args, device)
    if args.json:
        info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
        args.json.write_text(json.dumps({**info, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
