"""`h3 serve [MODE] [COUNT] [ATTN]`: the Videos API (OpenAI's shape) and a page, over ranks that keep
the model loaded; each replica group (`--replicas R`) takes the next job. docs/serve.md."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from h3cli import options
from h3cli.generate import _pick
from h3cli.output import Output
from h3core.errors import ConfigError
from h3core.parallel.modes import Mode


def serve(
    mode_arg: Annotated[Optional[str], typer.Argument(metavar="[MODE]", help="ulysses or tensor.", show_default=False)] = None,
    count_arg: Annotated[Optional[int], typer.Argument(metavar="[COUNT]", help="Ranks: GPUs on CUDA, Gloo processes on CPU.", show_default=False)] = None,
    attn_arg: Annotated[Optional[str], typer.Argument(metavar="[ATTN]", help="Attention backend.", show_default=False)] = None,
    replicas: options.Replicas = 1,
    host: Annotated[str, typer.Option("--host", help="Address to listen on. Anything but loopback needs --api-key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port (0: any free one; the first line says which).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Every route but /health and the page's files needs `Authorization: Bearer KEY`. Default: H3_API_KEY.", show_default=False)] = None,
    state_dir: Annotated[Path, typer.Option("--state-dir", help="The job queue (jobs.sqlite3), inputs and results; survives restarts and crashes.")] = Path("h3-serve"),
    allow_path: Annotated[Optional[list[Path]], typer.Option("--allow-path", help="A directory whose files requests may name as server-local keyframes or adapters (repeat for more). Default: none.", show_default=False)] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="Jobs waiting at once; more is 429.")] = 64,
    max_body_mb: Annotated[int, typer.Option("--max-body-mb", min=1, help="The largest request body (uploads included); more is 413.")] = 32,
    max_image_mb: Annotated[int, typer.Option("--max-image-mb", min=1, help="The largest keyframe image file.")] = 16,
    max_steps: Annotated[int, typer.Option("--max-steps", min=2, help="The most sigma points a request may ask for (the server's own --steps is not bound).")] = 100,
    max_frames: Annotated[int, typer.Option("--max-frames", min=1, help="The most frames a request may ask for, after snapping to 17n+5 (481: 20 s).")] = 481,
    served_model_name: Annotated[str, typer.Option("--served-model-name", help="The model name jobs carry and requests may give.")] = "h3",
    negative_prompt: options.NegativePrompt = "",
    guidance: options.Guidance = 1.0,
    cfg_parallel: options.CfgParallel = False,
    preset: options.RunPreset = None,
    width: options.Width = None,
    height: options.Height = None,
    frames: options.Frames = None,
    steps: options.Steps = None,
    seed: options.Seed = options.DEFAULT_SEED,
    mode: Annotated[Optional[Mode], typer.Option("--mode", help="Distributed mode.", show_default="ulysses")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", "-n", help="Ranks. Default: H3_WORLD_SIZE, else every visible GPU, else 1.")] = None,
    attention: Annotated[Optional[str], typer.Option("--attention", help="sdpa, math, sage2 or flash.", show_default="sdpa")] = None,
    device: options.Device = "auto",
    dtype: options.Dtype = None,
    model: options.Model = None,
    text_encoder: options.TextEncoder = None,
    video_vae: options.VideoVae = None,
    audio_vae: options.AudioVae = None,
    decoded_weights: options.DecodedWeights = "auto",
    compile_blocks: options.Compile = False,
    save_latents: Annotated[Optional[bool], typer.Option("--save-latents/--no-save-latents", help="Keep each job's latents.safetensors. Default: H3_SAVE_LATENTS, else yes.", show_default=False)] = None,
) -> None:
    """Serve the Videos API (POST /v1/videos, ...) and a page at /, with the model loaded once."""
    from h3core import settings
    from h3core.generate.request import GenerateJob, GenerateRequest
    from h3core.serve.engine import ServeJob
    from h3core.serve.inputs import Limits
    from h3core.serve.server import serve as run_server

    if mode_arg is not None and mode_arg not in (m.value for m in Mode):
        raise ConfigError(f"unknown mode {mode_arg!r}: the first argument is the mode, ulysses or tensor")
    flags = GenerateRequest(
        mode=Mode(_pick(mode_arg, mode.value if mode else None, "the mode") or Mode.ULYSSES.value),
        attention=_pick(attn_arg, attention, "the attention backend") or "sdpa",
        negative_prompt=negative_prompt, guidance_scale=guidance, cfg_parallel=cfg_parallel, replicas=replicas, preset=preset,
        width=width, height=height, frames=frames, steps=steps, seed=seed, device=device, dtype=dtype, model_path=model,
        text_encoder_path=text_encoder, decoded_weights=decoded_weights, compile=compile_blocks,
    )
    generate = GenerateJob.from_flags(flags, count=_pick(count_arg, gpus, "the rank count"), save_latents=save_latents)
    allowed = [_allowed_dir(p) for p in allow_path or []]
    job = ServeJob(
        template=generate.request, state_dir=state_dir, host=host, port=port, api_key=settings.api_key(api_key), allow_paths=allowed,
        limits=Limits(body_bytes=max_body_mb << 20, image_bytes=max_image_mb << 20, queue=max_queue, steps=max_steps, frames=max_frames), served_model=served_model_name,
        save_latents=generate.save_latents, video_vae=video_vae, audio_vae=audio_vae,
    )
    out = Output(False)
    run_server(job, say=lambda text: out.console.print(text, soft_wrap=True))


def _allowed_dir(path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(f"--allow-path {path} is not a directory; give a directory whose files requests may name")
    return path.resolve()


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
