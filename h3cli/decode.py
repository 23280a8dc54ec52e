"""`h3 decode LATENTS`: saved H3 latents -> video.mp4 with stereo audio, on this machine.

The two VAEs: `--video-vae` / `--audio-vae` (a Comfy file, a diffusers `vae/` / `audio_vae/` folder
or MiniMax's `video_vae/` / `audio_vae/`), else `H3_VIDEO_VAE_PATH` / `H3_AUDIO_VAE_PATH`, else the
folders beside `H3_MODEL_PATH`'s `transformer/`, else the embedded synthetic VAEs (noise, labelled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from h3cli import options
from h3cli.output import Output, styled
from h3core.reports.units import format_bytes


def render(report, console: Console) -> None:
    d = report.decode
    p = d.probe
    table = Table(title=f"h3 decode · {d.device_name} · weights: {d.weights}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("latents", f"{report.latents_file}: video {d.latents['video'].shape}, audio {d.latents['audio'].shape}")
    table.add_row("clip", d.geometry.describe())
    for vae in (d.video_vae, d.audio_vae):
        table.add_row(
            f"{vae.role} VAE",
            f"{vae.path} ({vae.found_by}) · {vae.container}, {vae.key_layout} names, {vae.file_dtype} on disk · "
            f"{vae.parameters / 1e6:.1f} M parameters{' · synthetic' if vae.synthetic else ''}",
        )
    t = d.timings
    table.add_row("time", f"load {t.load_s:.2f}s · video {t.video_s:.2f}s · audio {t.audio_s:.2f}s · mp4 {t.mux_s:.2f}s · files {t.write_s:.2f}s · total {t.total_s:.2f}s")
    table.add_row("peak memory", f"{d.memory_line()} ({d.peak_memory_kind})")
    table.add_row(
        "video.mp4",
        f"{p.video_codec} {p.pixel_format} {p.width}x{p.height} {p.fps:g} fps, {p.frames} frames, {p.video_duration_s:.3f}s · "
        f"{p.audio_codec} {p.audio_profile or ''} {p.channels} ch {p.sample_rate} Hz, {p.audio_duration_s:.3f}s · "
        f"A/V drift {p.av_drift_s * 1000:.1f} ms · {format_bytes(p.size_bytes)}",
    )
    if d.problems:
        table.add_row(styled("contract", "red"), styled("; ".join(d.problems), "red"))
    files = [d.files.video, d.files.preview, d.files.decoded, report.report]
    table.add_row("files", "\n".join(f for f in files if f))
    console.print(table)


def decode(
    latents: Annotated[Path, typer.Argument(metavar="LATENTS", help="latents.safetensors of an h3 generate run: video [24, T, H/16, W/16], audio [2, 32, T_a].", show_default=False)],
    video_vae: options.VideoVae = None,
    audio_vae: options.AudioVae = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="New or empty folder for video.mp4, preview.png and report.json. Default: outputs/<time>-decode-<4 hex>.", show_default=False)] = None,
    save_decoded: Annotated[bool, typer.Option("--save-decoded", help="Also write decoded.safetensors: video [3, F, H, W] in [0, 1], audio [2, samples] in [-1, 1] (no codec loss).")] = False,
    device: options.Device = "auto",
    overwrite: options.Overwrite = False,
    json: options.Json = False,
) -> None:
    """Decode saved latents into video.mp4 (H.264 24 fps + AAC stereo 32 kHz), preview.png and report.json."""
    from h3core.decode.command import DecodeJob, decode_latents_file

    job = DecodeJob(latents=latents, video_vae=video_vae, audio_vae=audio_vae, output=output, save_decoded=save_decoded, device=device, overwrite=overwrite)
    out = Output(json)
    console = out.err if json else out.console
    with console.status("decoding", spinner="dots") as status:
        report = decode_latents_file(job, on_phase=lambda phase: status.update(phase))
    out.result(report, lambda c: render(report, c))
    out.exit_for(report)


def register(app: typer.Typer) -> None:
    app.command("decode")(decode)
