"""The dry run: h3's own rank code at a run's real shapes on fake tensors, and the memory it would take.

Split by concern:

- `fakes`    what a rank's pipeline is given instead of its real instruments (`RankInstruments`):
             the fake meter, the simulated GPU's `DeviceKernels`, host arithmetic on real tensors,
             the checkpoint's header. Nothing is patched: each fake goes in through an argument.
- `predict`  predicting a rank's peak: `dry_run(run, arch)` runs `RankPipeline.load` and `denoise` for
             every distinct rank on fake tensors under a storage tracker (`RankPrediction`, `DryRun`);
             a dry run that cannot finish raises `DryRunFailed` (one line).
- `command`  the glue: the device-memory check before a CUDA run (`check_device_memory`: the dry run
             is the memory model, the formula its fallback, and the run's `MemoryCheck` says which),
             `h3 plan --memory` (`plan_memory`), and a prediction against a run's report
             (`python -m h3core.generate.dryrun REPORT [ARCH]`, scripts/gpu_check.sh).
"""

from h3core.generate.dryrun.command import PlanMemory, check_device_memory, compare_with_report, plan_memory, planned_preset, preset_run
from h3core.generate.dryrun.fakes import HeaderReader, header_only_file
from h3core.generate.dryrun.predict import (
    ARCHS,
    DEFAULT_STEPS,
    Arch,
    DryRun,
    HostSyncCount,
    RankPrediction,
    arch_of,
    dry_run,
    dry_run_problem,
    measured_cpu_run,
    predicted_peaks,
)

__all__ = [
    "ARCHS", "DEFAULT_STEPS", "Arch", "DryRun", "HeaderReader", "HostSyncCount", "PlanMemory", "RankPrediction", "arch_of",
    "check_device_memory", "compare_with_report", "dry_run", "dry_run_problem", "header_only_file", "measured_cpu_run",
    "plan_memory", "planned_preset", "predicted_peaks", "preset_run",
]
