"""The fp4 GEMM self-test: does this GPU's NVFP4 GEMM give the right numbers, at the model's shapes?

Why: SM120 fp4 GEMMs have been reported to return all zeros for particular M (flashinfer issues
2577 and 3398, on the RTX PRO 6000 boxes h3 runs on), and nothing else would notice: `--parity`
compares ranks that run the same kernel. So before any rank's first step, each (M, N, K) the run
will multiply is run once through the production GEMM (`matmul.scaled_mm_fp4`, alpha included) on
random codes and scales and compared with an exact CPU reference on a slice; zeros, NaNs or an error
beyond the bound below refuse the fp4 path, in one line naming the shape and the fallback taken
(`cuda-dequant-bf16`). It runs in a child process (`run_fp4_selftest`; `python -m
h3core.nvfp4.selftest`) started before the world, so a CUDA fault there (an illegal address
poisons a CUDA context for good) cannot take a rank down; the parent reads back one JSON record
(`FP4SelfTest`, for the run report).

The operands are built so that the check is sharp. Every code has a nonzero magnitude; A's signs
are constant along each row and B's along each of its rows (each output column), so all K
products of one output share a sign: no cancellation, |result| = sum of |products|, and no true
output is zero (a zero anywhere in the full output is a failure, counted on the GPU). Block scales
are random e4m3 values over 2^-4 .. 2^4 per (row, block), so a misplaced scale, row or tile
changes values by large factors. Two global scales that are not powers of two exercise alpha.

The bound. The reference is exact: the decoded operands (E2M1 x e4m3 values, at most 12
significant bits per product) multiplied in float64, times alpha = fl32(a_global * b_global) as
both GPU paths compute it. Against it, the GPU's result may differ by

    |got - ref| <= (eps + 2^-8 (1 + eps)) |ref|,  eps = 64 * 2^(1 - 13) + ceil(K / 64) * 2^-24 + 2^-24

2^-8 is the one rounding to bf16. In eps: an allowance for a tensor core that keeps only 13
significant bits while it sums each 64-element MMA step (truncating, so 2^(1-13) per add; the
DeepSeek-V3 report measured about 14 bits on Hopper's fp8 MMA, and nothing finer is documented for
Blackwell's block-scaled MMA), IEEE fp32 adds of the step partials, and the fp32 product with
alpha. Since no output cancels, these relative terms bound the error of every output: about 1.96%
at H3's widths. h3's own emulation (fp32 accumulation, `emulated_scaled_mm_fp4`) stays within
K * 2^-24 (0.09% at K = 14336) of the reference; an output off by 3% fails.
"""

from __future__ import annotations

import argparse
import importlib
import math
import subprocess
import sys
import time
from typing import Callable, Iterable, Literal, Sequence

import torch
from pydantic import BaseModel, Field

from h3core.nvfp4.codec import decode_rows
from h3core.nvfp4.matmul import FP4_IN_MULTIPLE, FP4_MIN_CAPABILITY, FP4_OUT_MULTIPLE, PATH_CUDA_BF16, PATH_CUDA_FP4, fp4_gemm_shape

Gemm = Callable[..., torch.Tensor]
Shape = tuple[int, int, int]

DEFAULT_SHAPES: tuple[Shape, ...] = ((1, 256, 128), (77, 1024, 512), (128, 512, 1024), (300, 2048, 5376), (1857, 5376, 7168))
"""(M, N, K) tested when no run asked for its own: single rows, a ragged M, whole tiles, H3's widths
(1857: H3's 14,855 tokens over 8 ranks). A run passes its own set (`model_gemm_shapes`)."""

MMA_STEP = 64
"""Elements of K one block-scaled fp4 MMA step sums (tcgen05 `kind::mxf4nvf4`: K = 64)."""

MMA_KEPT_BITS = 13
"""Significant bits the bound allows the tensor core to keep inside one MMA step (see the module docstring)."""

SAMPLED = 48
"""Rows (and columns) of the output compared with the reference: tile edges first, then random ones."""

SELFTEST_TIMEOUT_S = 600.0
"""The child process's time limit; past it the fp4 path is refused."""

SCALE_EXPONENTS = (3, 11)
"""Biased e4m3 exponents of the random block scales (inclusive): values 2^-4 .. 1.875 * 2^4."""

GLOBALS = (0.0371, 0.00293)
"""The activation and weight global scales of every test: not powers of two, so alpha's rounding shows."""


class GemmCheck(BaseModel):
    """One (M, N, K) through the GEMM, against the reference."""

    m: int
    n: int
    k: int
    verdict: Literal["ok", "zeros", "nonfinite", "wrong", "error"]
    detail: str = Field(description="One line: what was measured, or the error raised.")
    zero_outputs: int | None = Field(None, description="Zeros in the full [M, N] output (none is right).")
    nonfinite_outputs: int | None = Field(None, description="NaN or infinite values in the full output.")
    checked_outputs: int = Field(0, description="Outputs compared with the exact reference (a slice of rows x columns).")
    worst_over_bound: float | None = Field(None, description="max |got - ref| / bound over the slice; above 1 fails.")
    worst_relative_error: float | None = Field(None, description="max |got - ref| / |ref| over the slice.")
    seconds: float = 0.0

    @property
    def shape(self) -> str:
        return f"(M, N, K) = ({self.m}, {self.n}, {self.k})"


class FP4SelfTest(BaseModel):
    """The self-test's result, as the run report carries it."""

    device: str
    device_name: str = ""
    capability: list[int] | None = None
    torch: str = ""
    applicable: bool = Field(True, description="False where the device has no fp4 GEMM at all (before Blackwell, or a torch without float4).")
    accepted: bool = Field(description="True: NVFP4 linears may take cuda-fp4-scaled-mm.")
    path: str = Field(description="The path NVFP4 linears take on this device as a result.")
    reason: str = Field(description="One line: why accepted, or what was refused, at which shape, and the fallback.")
    bound: str = Field(description="The error bound every checked output had to meet.")
    checks: list[GemmCheck] = Field(default_factory=list)
    seconds: float = 0.0


def relative_bound(k: int) -> float:
    """The bound on |got - ref| / |ref| at inner width `k` (module docstring)."""
    eps = MMA_STEP * 2.0 ** (1 - MMA_KEPT_BITS) + math.ceil(k / MMA_STEP) * 2.0**-24 + 2.0**-24
    return eps + 2.0**-8 * (1 + eps)


BOUND_TEXT = (
    f"|got - ref| <= (eps + 2^-8 (1 + eps)) |ref|, eps = {MMA_STEP} * 2^(1 - {MMA_KEPT_BITS}) + ceil(K / {MMA_STEP}) * 2^-24 + 2^-24 "
    "(bf16 output rounding; a tensor core keeping 13 bits inside each 64-element MMA step; fp32 partial sums and alpha)"
)


def model_gemm_shapes(linears: Iterable[tuple[int, int]], token_counts: Iterable[int]) -> list[Shape]:
    """The (M, N, K) set a run multiplies: every linear (out, in) as the fp4 GEMM pads it, at every
    per-rank token count M (a rank's rows, or the gathered rows in tensor mode). Sorted, unique."""
    padded = {fp4_gemm_shape(out, inp) for out, inp in linears}
    return sorted({(m, n, k) for m in set(token_counts) if m > 0 for n, k in padded})


# --- the checks (any device; the GEMM is passed in) ---------------------------------------------------


def check_gemm(shape: Shape, gemm: Gemm, device: torch.device | str, seed: int = 0) -> GemmCheck:
    """Run `gemm` (the `scaled_mm_fp4` signature) at (M, N, K) on `device` and judge it."""
    m, n, k = shape
    if m < 1 or n % FP4_OUT_MULTIPLE or k % FP4_IN_MULTIPLE or n < 1 or k < 1:
        raise ValueError(f"fp4 GEMM shape {shape}: M >= 1, N a multiple of {FP4_OUT_MULTIPLE}, K of {FP4_IN_MULTIPLE}")
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + m * 7919 + n * 31 + k)
    a_packed, a_scale = _operand(m, k, gen)
    b_packed, b_scale = _operand(n, k, gen)
    a_global, b_global = (torch.tensor(g, dtype=torch.float32) for g in GLOBALS)
    from h3core.nvfp4.swizzle import swizzle_block_scales

    try:
        out = gemm(
            a_packed.to(device), swizzle_block_scales(a_scale).to(device), b_packed.to(device), swizzle_block_scales(b_scale).to(device),
            torch.bfloat16, a_global=a_global.to(device), b_global=b_global.to(device),
        )
        zeros, nonfinite = int((out == 0).sum()), int((~torch.isfinite(out)).sum())  # the full output
        rows, cols = _sampled(m, gen), _sampled(n, gen)
        got = out[rows][:, cols].double().cpu()  # [r, c]
    except Exception as err:  # a kernel that refuses or faults: the path is refused, the test goes on
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return GemmCheck(m=m, n=n, k=k, verdict="error", detail=f"{type(err).__name__}: {first}"[:300], seconds=time.perf_counter() - start)
    ref = _reference(a_packed[rows], a_scale[rows], b_packed[cols], b_scale[cols], a_global * b_global)
    return _judge(m, n, k, got, ref, zeros, nonfinite, time.perf_counter() - start)


def _operand(rows: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes [rows, k/2] (nonzero magnitudes, one sign per row) and row-major e4m3 block
    scales [rows, k/16] drawn from 2^-4 .. 2^4."""
    packed = torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8, generator=gen)
    low, high = packed & 0x07, (packed >> 4) & 0x07
    low = torch.where(low == 0, torch.ones_like(low), low)  # magnitude 0 -> 0.5: no zero products
    high = torch.where(high == 0, torch.ones_like(high), high)
    sign = torch.randint(0, 2, (rows, 1), dtype=torch.uint8, generator=gen) * 0x88  # both nibbles' bit 3
    packed = low | (high << 4) | sign
    low_exp, high_exp = SCALE_EXPONENTS
    exponent = torch.randint(low_exp, high_exp + 1, (rows, k // 16), dtype=torch.uint8, generator=gen)
    mantissa = torch.randint(0, 8, (rows, k // 16), dtype=torch.uint8, generator=gen)
    return packed, ((exponent << 3) | mantissa).view(torch.float8_e4m3fn)


def _sampled(size: int, gen: torch.Generator) -> torch.Tensor:
    """Up to `SAMPLED` indices of [0, size): the edges of the first and last 128-row tiles and of the
    32-row interleave, the last index, then random ones."""
    if size <= SAMPLED:
        return torch.arange(size)
    chosen = {i for i in (0, 1, 31, 32, 63, 64, 95, 96, 127, 128, size - 1, size - 2, size - 128, size - 129) if 0 <= i < size}
    for i in torch.randperm(size, generator=gen).tolist():
        if len(chosen) == SAMPLED:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen))


def _reference(a_packed: torch.Tensor, a_scale: torch.Tensor, b_packed: torch.Tensor, b_scale: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Exact: the decoded operands' products summed in float64, times alpha (its fp32 value)."""
    one = torch.ones((), dtype=torch.float32)
    a = decode_rows(a_packed, a_scale, one).double()  # [r, K], exact
    b = decode_rows(b_packed, b_scale, one).double()  # [c, K], exact
    return (a @ b.T) * alpha.double()


def _judge(m: int, n: int, k: int, got: torch.Tensor, ref: torch.Tensor, zeros: int, nonfinite: int, seconds: float) -> GemmCheck:
    total = m * n
    common = dict(m=m, n=n, k=k, zero_outputs=zeros, nonfinite_outputs=nonfinite, checked_outputs=got.numel(), seconds=seconds)
    if nonfinite:
        return GemmCheck(verdict="nonfinite", detail=f"{nonfinite:,} of {total:,} outputs are NaN or infinite", **common)
    if zeros:
        return GemmCheck(verdict="zeros", detail=f"{zeros:,} of {total:,} outputs are zero (none should be)", **common)
    error = (got - ref).abs()
    over = (error / (ref.abs() * relative_bound(k))).max().item()
    worst = (error / ref.abs()).max().item()
    common.update(worst_over_bound=over, worst_relative_error=worst)
    if over > 1:
        bad = int((error > ref.abs() * relative_bound(k)).sum())
        return GemmCheck(verdict="wrong", detail=f"{bad} of {got.numel()} checked outputs off by up to {worst:.3g} (bound {relative_bound(k):.3g})", **common)
    return GemmCheck(verdict="ok", detail=f"worst error {worst:.3g} of the output, {over:.2f} of the bound", **common)


def self_test(
    shapes: Sequence[Shape], gemm: Gemm, device: torch.device | str, *, device_name: str = "", capability: Sequence[int] | None = None, seed: int = 0
) -> FP4SelfTest:
    """Every shape through `gemm` on `device`; the fp4 path is accepted only if all pass."""
    start = time.perf_counter()
    checks = [check_gemm(tuple(shape), gemm, device, seed) for shape in shapes]  # type: ignore[arg-type]
    failed = [c for c in checks if c.verdict != "ok"]
    where = f"{device_name or device}" + (f" (sm_{capability[0]}{capability[1]})" if capability else "")
    if failed:
        first = failed[0]
        more = f" (and {len(failed) - 1} more shapes)" if len(failed) > 1 else ""
        reason = f"fp4 GEMM self-test on {where} failed at {first.shape}: {first.detail}{more}; NVFP4 linears take {PATH_CUDA_BF16}"
    else:
        worst = max((c.worst_over_bound or 0.0) for c in checks) if checks else 0.0
        reason = f"fp4 GEMM self-test on {where} passed at {len(checks)} shapes (worst {worst:.2f} of the bound)"
    return FP4SelfTest(
        device=str(device), device_name=device_name, capability=list(capability) if capability else None, torch=torch.__version__,
        accepted=not failed, path=PATH_CUDA_BF16 if failed else PATH_CUDA_FP4, reason=reason, bound=BOUND_TEXT, checks=checks,
        seconds=time.perf_counter() - start,
    )


def not_applicable(device: str, device_name: str, capability: Sequence[int] | None, why: str) -> FP4SelfTest:
    return FP4SelfTest(
        device=device, device_name=device_name, capability=list(capability) if capability else None, torch=torch.__version__,
        applicable=False, accepted=False, path=PATH_CUDA_BF16, reason=f"fp4 GEMM not available on {device_name or device}: {why}; NVFP4 linears take {PATH_CUDA_BF16}",
        bound=BOUND_TEXT,
    )


# --- in a child process, before the world ----------------------------------------------------------


def run_fp4_selftest(
    shapes: Sequence[Shape] = DEFAULT_SHAPES,
    device: str = "cuda:0",
    *,
    gemm: str = "scaled_mm",
    timeout_s: float = SELFTEST_TIMEOUT_S,
) -> FP4SelfTest:
    """The self-test in a fresh Python process (this process's CUDA context is never touched), its
    record read back from the child's stdout. A child that dies (a CUDA fault aborts it), hangs past
    `timeout_s` or prints no record refuses the fp4 path with that as the reason. Call it before
    the ranks start, pass the record to every rank (`h3core.nvfp4.kernels.DeviceKernels.of(device, record)`), put it in the run report."""
    command = [sys.executable, "-m", "h3core.nvfp4.selftest", "--device", device, "--gemm", gemm, "--shapes", _shapes_text(shapes)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return _refused(device, f"the self-test process ran past {timeout_s:.0f} s")
    try:
        return FP4SelfTest.model_validate_json(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return _refused(device, f"the self-test process died (exit code {done.returncode}: {last})")


def _refused(device: str, why: str) -> FP4SelfTest:
    return FP4SelfTest(device=device, torch=torch.__version__, accepted=False, path=PATH_CUDA_BF16,
                       reason=f"fp4 GEMM self-test on {device}: {why}; NVFP4 linears take {PATH_CUDA_BF16}", bound=BOUND_TEXT)


def _shapes_text(shapes: Sequence[Shape]) -> str:
    return ";".join(",".join(str(int(v)) for v in shape) for shape in shapes)


def _parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for part in filter(None, text.split(";")):
        m, n, k = (int(v) for v in part.split(","))
        shapes.append((m, n, k))
    return shapes


def _gemm_named(name: str) -> Gemm:
    """'scaled_mm' (the production CUDA GEMM), 'emulated' (h3's CPU emulation), or 'module:function'
    (a GEMM injected by a test)."""
    from h3core.nvfp4 import matmul

    if name == "scaled_mm":
        return matmul.scaled_mm_fp4
    if name == "emulated":
        return matmul.emulated_scaled_mm_fp4
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3core.nvfp4.selftest", description="The fp4 GEMM self-test; prints one JSON record.")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shapes", default=_shapes_text(DEFAULT_SHAPES), help="M,N,K;M,N,K;... (N a multiple of 16, K of 32)")
    parser.add_argument("--gemm", default="scaled_mm", help="scaled_mm (default), emulated, or module:function")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = _child_result(device, args)
    print(result.model_dump_json())
    return 0 if result.accepted or not result.applicable else 1  # 1: refused where the GPU has an fp4 GEMM


def _child_result(device: torch.device, args: argparse.Namespace) -> FP4SelfTest:
    name, capability = str(device), None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return not_applicable(str(device), "", None, "no CUDA device")
        name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        if tuple(capability) < FP4_MIN_CAPABILITY:
            return not_applicable(str(device), name, capability, f"compute capability {capability[0]}.{capability[1]} < 10.0")
        if not hasattr(torch, "float4_e2m1fn_x2"):
            return not_applicable(str(device), name, capability, f"torch {torch.__version__} has no float4_e2m1fn_x2")
    result = self_test(_parse_shapes(args.shapes), _gemm_named(args.gemm), device, device_name=name, capability=capability, seed=args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a fault surfacing here still kills only this process
    return result


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
