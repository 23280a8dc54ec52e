"""The files of one `h3 generate` run, staged in its output folder (`h3core.reports.outputs`): video.mp4
and its preview (the decode, unless --no-decode), the latents (unless not saved; without a decode the
preview is the video latent's), the report, and the report's `--benchmark` copy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from h3core.generate.report import RankReport, RunFiles, RunReport
from h3core.generate.request import ResolvedRun
from h3core.generate.wall import WallClock
from h3core.model.checkpoint import SYNTHETIC
from h3core.reports.outputs import FileInFolder, OutputFile, OutputFolder
from h3core.reports.preview import preview_png

if TYPE_CHECKING:
    from h3core.decode.plan import DecodePlan
    from h3core.decode.run import DecodeRun


def write_outputs(
    report: RunReport, outcome: RankReport, folder: OutputFolder, save_latents: bool, benchmark: OutputFile | FileInFolder | None, under: str = "",
    wall: WallClock | None = None, decoded: "DecodeRun | None" = None,
) -> RunFiles:
    """Stage video.mp4 and preview.png (the ranks' `decoded` clip, when given), the latents (unless not
    saved), and the report in `folder` (in its subfolder `under`), and the report copy in
    `benchmark`; they appear when the caller publishes them. The report names the paths the files
    will have. `wall`: the run's clock, whose split the report records as it is written."""
    place = (lambda name: str(Path(under) / name)) if under else (lambda name: name)
    latents = _latents(report, outcome, folder, place("latents.safetensors")) if save_latents else None
    video = None
    if decoded is not None:
        from h3core.decode.run import write_decode

        report.decode = write_decode(decoded, outcome.latents, folder, under=under)
    if report.decode is not None:
        report.timings["decode"] = report.decode.timings.total_s
        video, preview = report.decode.files.video, report.decode.files.preview
    else:
        preview = _preview(report, outcome, folder, place("preview.png"))
    report.files = RunFiles(
        directory=str(folder.path / under if under else folder.path),
        report=str(folder.path / place("report.json")),
        latents=str(latents) if latents else None,
        preview=str(preview) if preview else None,
        video=str(video) if video else None,
        benchmark=str(benchmark.path) if benchmark else None,
    )
    if wall is not None:
        report.wall = wall.split(report.timings, report.decode.timings.model_dump() if report.decode is not None else None)
    data = (report.model_dump_json(indent=2) + "\n").encode()
    if benchmark is not None:
        benchmark.write(data)
    folder.write(place("report.json"), data)
    return report.files


def clip_title(mode: str, world_size: int, seed: int) -> str:
    """The title of a run's decoded preview."""
    return f"h3 {mode} x{world_size} · seed {seed}"


def _latents(report: RunReport, outcome: RankReport, folder: OutputFolder, name: str) -> Path:
    from safetensors.torch import save as save_tensors

    tensors = {k: t.contiguous() for k, t in outcome.latents.items() if t is not None}
    # `weights: synthetic` travels with the latents: `h3 decode` labels what it makes of them
    metadata = {"seed": str(report.seed), "weights": SYNTHETIC if report.weights == SYNTHETIC else "checkpoint", "noise_recipe": report.noise_recipe}
    if report.keyframes is not None:  # condition_video's frames, in packed order
        metadata["keyframes"] = ",".join(report.keyframes.roles)
    return folder.write(name, save_tensors(tensors, metadata=metadata))


def _preview(report: RunReport, outcome: RankReport, folder: OutputFolder, name: str) -> Path | None:
    if outcome.video is None:
        return None
    title = f"h3 {report.mode.value} x{report.world_size} · seed {report.seed} · weights: {report.weights}"
    return folder.write(name, preview_png(outcome.video, title))


def output_bytes(run: ResolvedRun, save_latents: bool, decode: "DecodePlan | None" = None) -> int:
    """What a run writes, for the free-space check: the float32 latents when saved, the mp4's bound
    when decoded (report and preview fit in the outputs' margin)."""
    latents = 4 * run.shape.latent_elements if save_latents else 0
    return latents + (decode.output_bytes() if decode is not None else 0)
