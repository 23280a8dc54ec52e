"""`verify(config)`: the one call behind `h3 verify`.

In this process: resolve the device, build (or reuse) the preset's synthetic checkpoint, check
every partition the counts need (a count the model cannot split is a ConfigError, before anything
is spawned), reserve the report folder (`h3core.reports.outputs`), then start ONE World of max(usable
counts) ranks and run every selected check on it. The report is published whatever the verdicts
(nothing is written when the run itself fails or is interrupted); the caller raises
`report.failure()`.
"""

from __future__ import annotations

import time
from typing import Callable

from h3core.errors import ConfigError
from h3core.verify.rows import CheckRow, VerifyReport
from h3core.verify.session import Session
from h3core.verify.spec import VerifyConfig, VerifySpec

REPORT_FILE = "verify.json"


def build_spec(config: VerifyConfig, device: str) -> VerifySpec:
    """The spec every rank gets: the preset, its synthetic checkpoint (built here, once), the dtype."""
    from h3core.model.config import preset
    from h3core.model.synthetic import synthetic_checkpoint
    from h3core.runtime.device import compute_dtype, dtype_name

    model_config = preset(config.preset)
    path, _ = synthetic_checkpoint(model_config, seed=0)
    return VerifySpec(
        config=model_config, checkpoint=str(path), device=device, dtype=dtype_name(compute_dtype(device)),
        steps=config.steps, seed=config.seed,
    )


def unusable_counts(counts: list[int], device: str) -> dict[int, str]:
    """Counts this machine cannot run, with the reason: on CUDA one GPU per rank; Gloo ranks are unlimited."""
    if device != "cuda":
        return {}
    from h3core.runtime.device import visible_gpu_count

    gpus = visible_gpu_count()
    return {count: f"needs {count} GPUs, {gpus} visible" for count in counts if count > gpus}


def check_partitions(spec: VerifySpec, counts: list[int]) -> None:
    """Every count must split the heads, tokens and NVFP4 blocks of the spec (PartitionError otherwise)."""
    from h3core.parallel.modes import Mode

    for count in counts:
        spec.plan(count, Mode.TENSOR)


def run_checks(session: Session, names: list[str]) -> list[CheckRow]:
    from h3core.verify.checks import CHECKS

    rows: list[CheckRow] = []
    for name in names:
        rows.extend(CHECKS[name].run(session, CHECKS[name]))
    return rows


def verify(config: VerifyConfig, on_event: Callable[[str], None] | None = None) -> VerifyReport:
    """Run the checks of `config` on one World; write and return the report (also when rows failed)."""
    from h3core import settings
    from h3core.reports.outputs import Outputs
    from h3core.reports.schema import report_json
    from h3core.runtime.device import resolve_device

    started = time.perf_counter()
    notify = on_event or (lambda message: None)
    if settings.under_torchrun():
        raise ConfigError("h3 verify starts its own ranks (one per GPU of this machine); run it without torchrun")
    device = resolve_device(config.device)
    spec = build_spec(config, device)
    unusable = unusable_counts(config.counts, device)
    usable = [count for count in config.counts if count not in unusable]
    check_partitions(spec, usable)
    world_size = max(usable, default=1)
    with Outputs() as outputs:
        folder = outputs.folder(config.output, kind="verify", overwrite=config.overwrite)
        report = _run_on_world(config, spec, device, world_size, unusable, notify, started)
        report.report_path = str(folder.path / REPORT_FILE)
        folder.write(REPORT_FILE, report_json(report))
        outputs.publish()
    return report


def _run_on_world(config: VerifyConfig, spec: VerifySpec, device: str, world_size: int, unusable: dict[int, str],
                  notify: Callable[[str], None], started: float) -> VerifyReport:
    from h3core.reports.schema import Versions, timestamp
    from h3core.runtime.device import device_name
    from h3core.runtime.world import World

    notify(f"starting {world_size} rank{'s' if world_size > 1 else ''}")
    spawn_started = time.perf_counter()
    with World(world_size, device) as world:
        spawn_seconds = time.perf_counter() - spawn_started
        session = Session(world, spec, config.counts, unusable, notify)
        rows = run_checks(session, config.checks)
        dist_backend = world.backend
    return VerifyReport(
        created=timestamp(),
        passed=not any(row.verdict == "fail" for row in rows),
        device=device,
        device_name=device_name(device),
        dist_backend=dist_backend,
        dtype=spec.dtype,
        world_size=world_size,
        counts=config.counts,
        checks=config.checks,
        preset=config.preset,
        num_tokens=spec.num_tokens,
        segments=spec.segment_sizes,
        steps=spec.steps,
        seed=spec.seed,
        rows=rows,
        spawn_seconds=spawn_seconds,
        seconds=time.perf_counter() - started,
        versions=Versions.collect(),
    )
