#!/usr/bin/env python3
"""The two GPU kernels a step of H3 is made of, timed side by side at the real shapes (gpu_check.sh step).

1. Attention: `attend(q, k, v, "sdpa")` as h3 calls it (h3's rule picks the fused kernels,
   `h3core.model.attention.sdpa_rule.choose_sdpa_backends`), at H3's real lengths: the seed's 864x480x141
   (17,608 rows with 128 text rows) and the official 1344x768x243 (73,386 + 128), with all 56 heads
   (one GPU) and 7 (eight GPUs, Ulysses). Each allowed fused backend is also timed alone, so the
   table shows what h3's choice costs against the fastest fused kernel here. The math kernel is
   not run (its scores alone are 56 x S^2 x 2 bytes: 35 GB at 17,608 rows).
2. The fp4 path of one block linear: the activation quantizer (fused Triton kernel, and the eager
   codec it replaces) against the fp4 GEMM it feeds, and against the bf16 GEMM of the decoded
   weight (the dequant path's GEMM), at one GPU's rows (17,608) and eight GPUs' (2,201), for
   qkv_proj, out_proj, fc1 and fc2. On a GPU without an fp4 GEMM (before Blackwell) the fp4 columns
   are left out and the quantizer is still timed (tensor mode's codes-first gather uses it).

Every time is the median of `--repeat` CUDA-event-timed calls after one warm-up; what a row compares
runs in alternating rounds (`h3core.bench.alternate.rounds`: h3's attention and each fused kernel
alone; the bf16 GEMM, the quantizers, the fp4 GEMM and the fp4 forward), so the fastest fused kernel,
the ceiling h3's choice is held against, is measured in the same rounds; ratios are medians of the
per-round ratios. Against the physical limit, each row also gives what it achieved: the
attention's and the GEMMs' TFLOP/s (4 S^2 H Dh and 2 M N K multiply-adds counted as 2 FLOPs) and
the quantizer's GB/s (bf16 read, codes and scales written), to hold against the GPU's datasheet
peaks. `--json FILE` writes the rows.

    python scripts/bench_gpu_kernels.py --repeat 10 --json kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

H3_HEADS, H3_HEAD_DIM = 56, 128
H3_LINEARS = {"qkv_proj": (3 * 7168, 5376), "out_proj": (5376, 7168), "fc1": (2 * 14336, 5376), "fc2": (5376, 14336)}  # (out, in)
TEXT_ROWS = 128
LENGTHS = {"864x480x141": (864, 480, 141), "1344x768x243": (1344, 768, 243)}


def cuda_seconds(fn: Callable[[], object]) -> Callable[[], float]:
    """One call of `fn` timed by CUDA events, in seconds (an arm of `alternate`)."""

    def run() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    return run


def alternating_medians(arms: dict[str, Callable[[], object]], repeat: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each arm's median seconds over `repeat` alternating rounds after one warm-up round, and the times."""
    from h3core.bench.alternate import alternate

    times = alternate({name: cuda_seconds(fn) for name, fn in arms.items()}, repeat)
    return {name: statistics.median(t) for name, t in times.items()}, times


def median_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    from h3core.bench.alternate import ratios

    return statistics.median(ratios(times[numerator], times[denominator]))


def attention_rows(repeat: int) -> list[dict]:
    from collections import Counter

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from h3core.model.attention.dispatch import attend
    from h3core.model.attention.sdpa_rule import sdpa_choice_here
    from h3core.model.config import preset

    config = preset("h3")
    backends = {"flash_attention": SDPBackend.FLASH_ATTENTION, "efficient_attention": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn_attention": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for name, (w, h, f) in LENGTHS.items():
        seq = config.num_tokens(w, h, f, TEXT_ROWS)
        choice = sdpa_choice_here(torch.bfloat16, H3_HEAD_DIM, seq)
        for heads in (H3_HEADS, H3_HEADS // 8):
            q, k, v = (torch.randn(seq, heads, H3_HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            record: Counter[str] = Counter()

            def alone(backend: str) -> Callable[[], object]:
                def run() -> object:
                    with sdpa_kernel([backends[backend]]):
                        return attend(q, k, v, "sdpa")
                return run

            arms = {"h3": lambda: attend(q, k, v, "sdpa", record), **{b: alone(b) for b in choice.backends}}
            medians, times = alternating_medians(arms, repeat)
            h3_s = medians.pop("h3")
            fastest = min(medians, key=medians.__getitem__) if medians else None
            rows.append({"what": "attention", "clip": name, "rows": seq, "heads": heads, "h3_seconds": h3_s, "h3_kernels": dict(record),
                         "h3_tflops": 4 * seq * seq * heads * H3_HEAD_DIM / h3_s / 1e12, "rule": choice.reason, "alone_seconds": medians,
                         "h3_over_fastest": median_ratio(times, "h3", fastest) if fastest else None})
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def linear_rows(repeat: int) -> list[dict]:
    from h3core.nvfp4 import activation
    from h3core.nvfp4.codec import NVFP4Weight, dequantize, global_scale_for
    from h3core.nvfp4.linear import NVFP4Linear
    from h3core.nvfp4.matmul import PATH_CUDA_FP4, fp4_gemm_shape, scaled_mm_fp4

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (out_features, in_features) in H3_LINEARS.items():
        packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, device="cuda", generator=gen)
        scale = (torch.rand(out_features, in_features // 16, device="cuda", generator=gen) * 2 + 0.25).to(torch.float8_e4m3fn)
        linear = NVFP4Linear(NVFP4Weight(packed, scale, torch.tensor(1e-3, device="cuda")))
        linear.prepare()
        fp4 = linear.path == PATH_CUDA_FP4
        dense = dequantize(linear.nvfp4, torch.bfloat16)
        _, width = fp4_gemm_shape(out_features, in_features)
        for m in (17_608, 2_201):
            x = torch.randn(m, in_features, device="cuda", dtype=torch.bfloat16)
            gs = global_scale_for(x)
            row = {"what": "linear", "linear": name, "M": m, "N": out_features, "K": in_features, "path": linear.path}
            flops, quantizer_bytes = 2 * m * out_features * in_features, m * in_features * 2 + m * width // 2 + m * width // 16
            arms: dict[str, Callable[[], object]] = {"bf16_gemm": lambda: F.linear(x, dense),
                                                     "eager_quantizer": lambda: activation.eager_quantize_activation(x, gs, width)}
            if activation.triton_available():
                arms["fused_quantizer"] = lambda: activation.fused_quantize_activation(x, gs, width)
            if fp4:
                a_packed, a_scale = activation.quantize_activation(x, gs, width)
                weight = linear.fp4_weight if linear.fp4_weight is not None else linear.weight
                arms["fp4_gemm"] = lambda: scaled_mm_fp4(a_packed, a_scale, weight, linear.swizzled_weight_scale, a_global=gs, b_global=linear.weight_scale_2)
                arms["fp4_forward"] = lambda: linear(x)
            medians, times = alternating_medians(arms, repeat)
            row.update({f"{arm}_seconds": seconds for arm, seconds in medians.items()})
            row["bf16_gemm_tflops"] = flops / row["bf16_gemm_seconds"] / 1e12
            if "fused_quantizer_seconds" in row:
                row["fused_quantizer_gbps"] = quantizer_bytes / row["fused_quantizer_seconds"] / 1e9
            if fp4:
                row["fp4_gemm_tflops"] = flops / row["fp4_gemm_seconds"] / 1e12
                quantizer = "fused_quantizer" if "fused_quantizer" in arms else "eager_quantizer"
                row["quantizer_over_fp4_gemm"] = median_ratio(times, quantizer, "fp4_gemm")
                row["fp4_forward_over_bf16_gemm"] = median_ratio(times, "fp4_forward", "bf16_gemm")
            rows.append(row)
            del x
        del linear, dense, packed, scale
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU (it times CUDA kernels)")
        return 2
    rows = attention_rows(args.repeat) + linear_rows(args.repeat)
    for row in rows:
        if row["what"] == "attention":
            print(f"attention {row['clip']} S={row['rows']:,} H={row['heads']}: h3 {row['h3_seconds'] * 1e3:.2f} ms ({row['h3_tflops']:.0f} TFLOP/s) {row['h3_kernels']} "
                  f"(x{row['h3_over_fastest'] or 0:.2f} of the fastest fused kernel alone) · {row['rule']}")
        else:
            parts = [f"bf16 GEMM {row['bf16_gemm_seconds'] * 1e3:.2f} ms ({row['bf16_gemm_tflops']:.0f} TFLOP/s)",
                     f"eager quantizer {row['eager_quantizer_seconds'] * 1e3:.2f} ms"]
            if "fused_quantizer_seconds" in row:
                parts.append(f"fused quantizer {row['fused_quantizer_seconds'] * 1e3:.3f} ms ({row['fused_quantizer_gbps']:.0f} GB/s)")
            if "fp4_gemm_seconds" in row:
                parts += [f"fp4 GEMM {row['fp4_gemm_seconds'] * 1e3:.2f} ms ({row['fp4_gemm_tflops']:.0f} TFLOP/s)", f"quantizer/GEMM {row['quantizer_over_fp4_gemm']:.2f}",
                          f"fp4 forward/bf16 GEMM {row['fp4_forward_over_bf16_gemm']:.2f}"]
            print(f"{row['linear']} M={row['M']:,}: " + " · ".join(parts))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "repeat": args.repeat, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
