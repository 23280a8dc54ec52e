"""`h3 compare A B`: PSNR and SSIM of two runs' videos and the SNR of their audio (h3core.decode.compare)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from h3cli import options
from h3cli.output import Output, styled


def _db(value: float | None) -> str:
    return "inf (identical)" if value is None else f"{value:.2f} dB"


def render(result, console: Console) -> None:  # noqa: ANN001 - a ClipDistance
    console.print(f"A {result.a}\nB {result.b}\n{result.frames} frames of {result.width}x{result.height}")
    console.print(f"video: PSNR {_db(result.psnr_db)} (worst frame {_db(result.psnr_worst_frame_db)}) · "
                  f"SSIM {result.ssim:.4f} (worst frame {result.ssim_worst_frame:.4f})")
    console.print(f"audio: SNR {_db(result.audio_snr_db)}")
    if result.synthetic:
        console.print(styled("synthetic weights: both clips are noise, so these figures say nothing about quality", "yellow"))


def compare(
    a: Annotated[Path, typer.Argument(metavar="A", help="The reference: a video.mp4 or an h3 run's folder.", show_default=False)],
    b: Annotated[Path, typer.Argument(metavar="B", help="The clip compared with A: a video.mp4 or an h3 run's folder.", show_default=False)],
    json: options.Json = False,
) -> None:
    """How far two runs' clips are apart: PSNR and SSIM of the video, SNR of the audio (judge a --cache setting, an adapter, NVFP4 vs bf16)."""
    from h3core.decode.compare import compare_clips

    out = Output(json)
    result = compare_clips(a, b)
    out.result(result, lambda console: render(result, console))


def register(app: typer.Typer) -> None:
    app.command("compare")(compare)
