"""`h3 generate`: text -> video + audio latents on 1..N ranks, in Ulysses or tensor mode.

Seed form: `h3 generate [MODE] [COUNT] [ATTN]`, e.g. `h3 generate tensor 8 sdpa`; the same can be
given as `--mode/--gpus/--attention` (a flag and a positional that disagree is an error).
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from h3cli import options
from h3cli.batch import run_batch_command
from h3cli.output import Output, line, progress_bar, styled, text_column
from h3core.errors import ConfigError
from h3core.parallel.modes import Mode
from h3core.reports.units import format_bytes


def render_run(report, console: Console) -> None:
    table = Table(title=f"h3 generate · {report.mode.value} · {report.ranks_on} · weights: {report.weights}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    s = report.shape
    snapped = f" (asked {s.frames_requested}: snapped up to 17n+5)" if s.frames != s.frames_requested else ""
    schedule = f" (schedule: {s.schedule_source})" if s.schedule_source else ""
    table.add_row("request", f"{s.width}x{s.height}, {s.frames} frames{snapped}, {s.steps} sigma points ({s.steps - 1} forwards){schedule}, seed {report.seed} "
                  f"({report.noise_recipe} noise), guidance {report.guidance_scale}")
    if report.canvas is not None:
        table.add_row("canvas", f"{report.canvas.width}x{report.canvas.height}: {report.canvas.reason}")
    if report.keyframes is not None:
        k = report.keyframes
        table.add_row("keyframes", " · ".join(f"{role} {path} ({w}x{h})" for role, path, (w, h) in zip(k.roles, k.paths, k.sizes))
                      + f" · encoded by {k.video_vae or 'the synthetic video VAE'}")
    for a in report.adapters:
        table.add_row("LoRA", f"{a.name} ({a.format}) x{a.scale:g}: {a.layers} linears, rank {'/'.join(map(str, a.ranks))}, sha256 {a.sha256[:12]}…, "
                              f"{' · '.join(format_bytes(b) for b in a.bytes_per_rank)} per rank")
    table.add_row("sequence", f"{report.num_tokens} rows · " + ", ".join(f"{kind} {rows}" for kind, rows in report.rows.items() if rows))
    table.add_row("layout", layout_line(report.partition.layout))
    table.add_row("partition", f"heads {report.partition.heads} · tokens {report.partition.tokens}" + (" (each group)" if len(report.partition.layout.groups) > 1 else ""))
    if report.partition.overlap is not None and report.world_size > 1:
        o = report.partition.overlap
        table.add_row("ulysses overlap", f"{o.groups} head groups per all-to-all: {o.reason}" if o.on else f"off: {o.reason}")
    table.add_row("compute", f"{report.device_name} · {report.dtype} · attention {report.attention_kernel} · NVFP4 {report.nvfp4_path}")
    if report.fp4_selftest:
        verdicts = sorted({r.reason for r in report.fp4_selftest.values()})
        untested = f" · {len(report.fp4_untested_shapes)} GEMM shapes ran untested" if report.fp4_untested_shapes else ""
        table.add_row("fp4 self-test", f"{len(report.fp4_selftest)} GPU(s): " + "; ".join(verdicts) + untested)
    t = report.timings
    steps = report.step_seconds
    table.add_row(
        "time",
        f"text {t.get('text_encode', 0):.2f}s · load {t.get('load', 0):.2f}s · sampling {t.get('sampling', 0):.2f}s "
        f"(median step {median(steps) if steps else 0:.3f}s) · gather {t.get('gather', 0):.3f}s",
    )
    if report.cache is not None:
        table.add_row("step cache", report.cache.line())
    if report.compile is not None:
        table.add_row("compile", report.compile.line())
    if report.wall is not None:
        table.add_row("wall time", report.wall.line())
    table.add_row("peak memory", " · ".join(_peak(r) for r in report.ranks))
    if report.memory_check is not None:
        table.add_row("memory check", report.memory_check.line)
    table.add_row(
        "weights / rank",
        " · ".join(f"r{r.rank} {format_bytes(r.weights.resident)} held ({r.weights.block_share:.0%} of block linears), {format_bytes(r.weights.read)} read" for r in report.ranks),
    )
    if report.comm_total.kinds:
        table.add_row("collectives (sent, all ranks)", " · ".join(f"{k} {format_bytes(c.bytes_sent)} in {c.calls} calls" for k, c in sorted(report.comm_total.kinds.items())))
    for name in ("video", "audio"):
        c = getattr(report, name)
        if c is not None:
            table.add_row(name, f"{c.shape} sha256 {c.sha256[:16]}… sum {c.sum:.6g}")
    if report.parity:
        p = report.parity
        verdict = styled("bitwise identical", "green") if p.bitwise else (styled("ok", "green") if p.passed else styled("FAILED", "red"))
        table.add_row("parity", line(f"vs {p.reference}: max abs {p.max_abs:.3g}, relative {p.relative:.3g} (tolerance {p.tolerance:g}) ", verdict))
    if report.decode is not None:
        d, p = report.decode, report.decode.probe
        table.add_row(
            "decode",
            f"{d.device_name} · load {d.timings.load_s:.2f}s · video {d.timings.video_s:.2f}s · audio {d.timings.audio_s:.2f}s · mp4 {d.timings.mux_s:.2f}s · "
            f"{d.ranks} rank{'s' if d.ranks > 1 else ''} · {d.memory_line()} · weights: {d.weights}",
        )
        table.add_row(
            "video.mp4",
            f"{p.video_codec} {p.width}x{p.height} {p.fps:g} fps, {p.frames} frames, {p.video_duration_s:.3f}s · {p.audio_codec} {p.channels} ch "
            f"{p.sample_rate} Hz · A/V drift {p.av_drift_s * 1000:.1f} ms" + (styled(" · " + "; ".join(d.problems), "red") if d.problems else ""),
        )
    if report.files:
        f = report.files
        table.add_row("files", "\n".join(x for x in (f.video, f.preview, f.latents or "(latents not saved)", f.report) if x))
    console.print(table)
    if report.profile is not None:
        render_profile(report.profile, console)


def layout_line(layout) -> str:
    """'world 4 = 1 replica x 2 CFG halves x 2 ranks per sequence: ranks 0-1 prompt · ranks 2-3 negative prompt'."""
    groups = " · ".join(f"ranks {_ranks(g.ranks)} {' + '.join(g.runs)}" for g in layout.groups)
    exchange = "; one cfg_exchange per step" if layout.cfg_parallel else ""
    return f"{layout.describe()}: {groups}{exchange}"


def _peak(rank) -> str:
    """'r0 501 MiB (+41.6 MiB sampling)': the window's peak, and what sampling added to what the rank held at its start."""
    added = rank.peak_memory_sampling_bytes - rank.memory_before_sampling_bytes
    grew = f" (+{format_bytes(added)} sampling)" if rank.memory_before_sampling_bytes and added >= 0 else ""
    return f"r{rank.rank} {format_bytes(rank.peak_memory_sampling_bytes)}{grew}"


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def render_profile(profile, console: Console) -> None:
    """Where a step goes: seconds per step per category for every rank, their mean and its share."""
    from h3core.generate.profile import shares  # (torch: only when a profile is rendered)

    ranks = profile.ranks
    table = Table(
        title=f"where a step goes (--profile, {ranks[0].clock}): seconds per step, mean over {len(ranks[0].steps)} steps",
        title_justify="left",
    )
    table.add_column("category")
    for r in ranks:
        table.add_column(f"r{r.rank}", justify="right")
    table.add_column("mean", justify="right")
    table.add_column("share", justify="right")
    per_rank = [r.mean for r in ranks]
    for name, seconds, share in shares(profile.mean):
        table.add_row(name.replace("_", " "), *(f"{m.get(name, 0.0):.4f}" for m in per_rank), f"{seconds:.4f}", f"{share:.0%}")
    table.add_row("step", *(f"{m.get('step', 0.0):.4f}" for m in per_rank), f"{profile.mean.get('step', 0.0):.4f}", "100%", style="bold")
    console.print(table)
    if profile.overlap_line() is not None:
        console.print(profile.overlap_line())


def _pick(positional, flag, what: str):
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"{what} given twice with different values ({positional} and {flag}); give it once")
    return positional if positional is not None else flag


def generate(
    mode_arg: Annotated[Optional[str], typer.Argument(metavar="[MODE]", help="ulysses or tensor (seed form).", show_default=False)] = None,
    count_arg: Annotated[Optional[int], typer.Argument(metavar="[COUNT]", help="Number of GPUs/ranks (seed form).", show_default=False)] = None,
    attn_arg: Annotated[Optional[str], typer.Argument(metavar="[ATTN]", help="Attention backend (seed form).", show_default=False)] = None,
    prompt: options.Prompt = None,
    negative_prompt: options.NegativePrompt = "",
    guidance: options.Guidance = 1.0,
    cfg_parallel: options.CfgParallel = False,
    replicas: options.Replicas = 1,
    preset: options.RunPreset = None,
    width: options.Width = None,
    height: options.Height = None,
    frames: options.Frames = None,
    steps: options.Steps = None,
    seed: options.Seed = options.DEFAULT_SEED,
    keyframe: options.Keyframe = None,
    noise_recipe: options.NoiseRecipeOption = "official",
    video_shift: options.VideoShift = None,
    audio_shift: options.AudioShift = None,
    lora: options.Lora = None,
    mode: Annotated[Optional[Mode], typer.Option("--mode", help="Distributed mode.", show_default="ulysses")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", "-n", help="Ranks: GPUs on CUDA, Gloo processes on CPU. Default: H3_WORLD_SIZE, else every visible GPU, else 1.")] = None,
    attention: options.Attention = None,
    device: options.Device = "auto",
    dtype: options.Dtype = None,
    model: options.Model = None,
    text_encoder: options.TextEncoder = None,
    output: options.GenerateOutput = None,
    save_latents: options.SaveLatents = None,
    benchmark: options.Benchmark = None,
    parity: Annotated[bool, typer.Option("--parity", help="Also run one rank with the same seed and record the latent error (at 1 rank: vs the other mode).")] = False,
    overwrite: options.Overwrite = False,
    profile: options.Profile = False,
    cache: options.Cache = "off",
    ulysses_overlap: options.UlyssesOverlap = "auto",
    compile_blocks: options.Compile = False,
    decoded_weights: options.DecodedWeights = "auto",
    decode: Annotated[bool, typer.Option("--decode/--no-decode", help="Decode the latents into video.mp4 (H.264 + AAC) once the ranks are done; --no-decode: latents only (then `h3 decode`).")] = True,
    video_vae: options.VideoVae = None,
    audio_vae: options.AudioVae = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Many prompts, one load: a text file (one prompt per line) or JSONL (prompt, negative_prompt, seed, width, height, frames, steps, guidance, keyframes {first, last}, name); the flags are every prompt's defaults. A folder per prompt and batch.json in --output; the same command again resumes.", show_default=False)] = None,
    json: options.Json = False,
) -> None:
    """Generate video + audio latents from a prompt, on one rank or across all of them."""
    from h3core.generate.keyframes import parse_keyframe_flags
    from h3core.generate.request import DEFAULT_PROMPT, GenerateJob, GenerateRequest
    from h3core.generate.run import generate as run_generate
    from h3core.lora import parse_lora

    if mode_arg is not None and mode_arg not in (m.value for m in Mode):
        raise ConfigError(f"unknown mode {mode_arg!r}: the first argument is the mode, ulysses or tensor")
    if prompts is not None:
        _check_batch_flags(prompt, parity)
    flags = GenerateRequest(
        mode=Mode(_pick(mode_arg, mode.value if mode else None, "the mode") or Mode.ULYSSES.value),
        attention=_pick(attn_arg, attention, "the attention backend") or "sdpa",
        prompt=DEFAULT_PROMPT if prompt is None else prompt, negative_prompt=negative_prompt, guidance_scale=guidance,
        cfg_parallel=cfg_parallel, replicas=replicas, preset=preset, width=width, height=height, frames=frames, steps=steps, seed=seed,
        device=device, dtype=dtype, model_path=model, text_encoder_path=text_encoder, profile=profile, decoded_weights=decoded_weights,
        keyframes=parse_keyframe_flags(keyframe or []), noise_recipe=noise_recipe,
        video_shift=video_shift, audio_shift=audio_shift, loras=tuple(parse_lora(text) for text in lora or ()), cache=cache,
        ulysses_overlap=ulysses_overlap,
        compile=compile_blocks,
    )
    job = GenerateJob.from_flags(
        flags, count=_pick(count_arg, gpus, "the rank count"), output=output, save_latents=save_latents,
        benchmark=benchmark, parity=parity, overwrite=overwrite, decode=decode, video_vae=video_vae, audio_vae=audio_vae,
    )
    out = Output(json)
    if prompts is not None:
        return run_batch_command(job, prompts, out)
    with progress_bar(out.err if json else out.console, *_BAR) as update:
        report = run_generate(
            job, on_step=lambda msg: update(completed=msg.step, total=msg.steps, description=f"{msg.seconds:.2f}s/step"),
            on_phase=lambda phase: update(description=phase),
        )
    if report is not None and report.memory_check is not None and report.memory_check.failed:
        out.warn(report.memory_check.line)  # a dry run that could not finish says so, in one line
    out.result(report, lambda console: render_run(report, console))
    out.exit_for(report)


def _check_batch_flags(prompt: str | None, parity: bool) -> None:
    """What `--prompts` cannot take with it: each is one line, before anything runs."""
    if prompt is not None:
        raise ConfigError("--prompts and --prompt given together: put every prompt in the --prompts file, or give one --prompt")
    if parity:
        raise ConfigError("--parity runs with one prompt: run `h3 generate --prompt ... --parity` (a batch's prompts are each what `h3 generate` gives)")


_BAR = (text_column("denoising", "bold"), BarColumn(), MofNCompleteColumn(), text_column("{task.description}"), TimeElapsedColumn(), TimeRemainingColumn())


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
