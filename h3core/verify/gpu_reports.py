"""What `scripts/gpu_check.sh` concludes from the reports it collected: a list of problems.

Torch-free and device-free (the expected NVFP4 path is passed in), so the conclusions that decide
the first GPU run are checked on the CPU; only `sdpa_rule_for_report`, which asks this GPU, imports
torch (when called). A problem is one line saying what ran and what should have:

- attention: any rank ran an unfused kernel (SDPA's math fallback, or h3's math reference) in the
  generate run at H3's shapes, or a kernel that is not SDPA's, or (given the rule's verdict for this
  GPU, `sdpa-rule.json` from `sdpa_rule_for_report` below) a fused kernel the rule
  does not allow here, e.g. cuDNN attention below cuDNN 9.15.1 at H3's lengths;
- NVFP4: any rank's linears took another path than `expected_path` (in the generate run: every
  path each rank ran; in the linear benchmark: each shape's path);
- parity: the generate run's parity did not pass; a report that is missing or unreadable.

    python -m h3core.verify.gpu_reports OUTPUT_DIR EXPECTED_PATH [SDPA_RULE_JSON]   # prints the summary, exits 1 on a problem
    python -m h3core.verify.gpu_reports --sdpa-rule GENERATE_JSON                    # prints this GPU's rule for that run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from h3core.errors import ConfigError
from h3core.files.text import read_json

UNFUSED_KERNELS = ("sdpa:math", "h3 math (fp32 softmax)")


def generate_problems(report: dict[str, Any], expected_path: str, sdpa_rule: dict[str, Any] | None = None) -> list[str]:
    """Problems of an `h3 generate --json` report (per rank: attention kernels, NVFP4 paths; parity).
    `sdpa_rule`: `{"allowed": [kernel, ...], "reason": ...}`, the kernels h3's rule allows on this GPU."""
    if "ranks" not in report:
        return ["generate: no report (the run failed; see generate.log)"]
    problems = []
    for rank in report["ranks"]:
        kernels, paths = rank.get("attention_kernels") or {}, rank.get("nvfp4_paths") or {}
        if not kernels:
            problems.append(f"generate rank {rank['rank']}: no attention kernel recorded")
        for kernel in kernels:
            if kernel in UNFUSED_KERNELS or not kernel.startswith("sdpa:"):
                problems.append(f"generate rank {rank['rank']}: attention ran {kernel}, not a fused SDPA kernel")
            elif sdpa_rule is not None and kernel not in sdpa_rule["allowed"]:
                problems.append(f"generate rank {rank['rank']}: attention ran {kernel}, which h3's rule refuses here ({sdpa_rule['reason']})")
        if set(paths) != {expected_path}:
            problems.append(f"generate rank {rank['rank']}: NVFP4 paths {sorted(paths)}, expected only {expected_path}")
    parity = report.get("parity")
    if parity is not None and not parity.get("passed"):
        problems.append(f"generate: parity {parity.get('relative'):.3g} > tolerance {parity.get('tolerance'):.3g}")
    return problems


def sdpa_rule_for_report(report_path: str | Path) -> str:
    """JSON of h3's SDPA rule on this GPU for the run an `h3 generate --json` report describes (its
    dtype, head width and packed length): what `generate_problems` checks each rank's kernels against."""
    import torch

    from h3core.model.attention.sdpa_rule import sdpa_choice_here

    report = read_json(report_path, "the report", 64 << 20, "give the report of an h3 generate --json run", want=dict)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    choice = sdpa_choice_here(dtypes[report["dtype"]], report["config"]["head_dim"], report["num_tokens"])
    return json.dumps({"allowed": list(choice.kernels), "reason": choice.reason, "torch_default_prefers_cudnn": choice.torch_default_prefers_cudnn})


def linear_bench_problems(report: dict[str, Any], expected_path: str) -> list[str]:
    """Problems of `scripts/bench_nvfp4_linear.py --json`: every H3 shape on the expected path."""
    rows = report.get("rows")
    if not rows:
        return ["nvfp4-linear: no rows (the benchmark failed; see nvfp4-linear.log)"]
    return [f"nvfp4-linear {r['name']}: path {r['path']}, expected {expected_path}" for r in rows if r["path"] != expected_path]


def summary_lines(generate: dict[str, Any], linear_bench: dict[str, Any]) -> list[str]:
    lines = [
        f"nvfp4 {r['name']:<10} {r['shape']:<12} bf16 {r['dense_tflops']:.1f} TFLOP/s  nvfp4 {r['nvfp4_tflops']:.1f} TFLOP/s  ({r['path']})"
        for r in linear_bench.get("rows", [])
    ]
    if "timings" in generate:
        steps = sorted(generate["step_seconds"])
        parity = generate.get("parity") or {}
        lines.append(
            f"generate {generate['config']['name']} x{generate['world_size']} on {generate['device_name']}: "
            f"sampling {generate['timings']['sampling']:.2f}s, median step {steps[len(steps) // 2]:.3f}s, "
            f"peak {max(r['peak_memory_sampling_bytes'] for r in generate['ranks']):,} bytes, "
            f"attention {generate['attention_kernel']}, NVFP4 {generate['nvfp4_path']}, "
            f"parity {parity.get('relative')} (tolerance {parity.get('tolerance')})"
        )
    return lines


def _load(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        return read_json(path, "the report", 64 << 20, "rerun the check that writes it", want=dict)
    except ConfigError as err:
        problems.append(str(err))
        return {}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--sdpa-rule"]:
        print(sdpa_rule_for_report(argv[1]))
        return 0
    out, expected_path = Path(argv[0]), argv[1]
    problems: list[str] = []
    generate, linear_bench = _load(out / "generate.json", problems), _load(out / "nvfp4-linear.json", problems)
    sdpa_rule = (_load(Path(argv[2]), problems) or None) if len(argv) > 2 else None  # unreadable: a problem, and no rule
    problems += generate_problems(generate, expected_path, sdpa_rule) + linear_bench_problems(linear_bench, expected_path)
    for line in summary_lines(generate, linear_bench):
        print(line)
    for problem in problems:
        print("FAIL", problem)
    print("checks: " + ("all passed" if not problems else f"{len(problems)} failed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
