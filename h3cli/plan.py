"""`h3 plan`: print the partition contract for a rank count (the same `ParallelPlan` a run's ranks get)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from h3cli import options
from h3cli.output import Output, line, styled
from h3core.errors import ConfigError
from h3core.parallel.modes import Mode, mode_of
from h3core.parallel.plan import ParallelPlan
from h3core.reports.units import format_bytes


def _render(plan: ParallelPlan, console: Console) -> None:
    _render_groups(plan, console)
    seg_text = ", ".join(f"{s.kind} {len(s)}" for s in plan.segments)
    each = " of each group" if len(plan.layout.groups) > 1 else ""
    table = Table(
        title=f"{plan.preset} · {plan.mode.value} · {plan.world_size} rank(s){each} · {plan.num_tokens} tokens ({seg_text})",
        title_justify="left",
    )
    w = plan.weights
    if w is not None:
        table.caption = (
            f"{plan.preset}: {w.parameters / 1e9:.2f} B weights, checkpoint {w.checkpoint_bytes:,} bytes "
            f"({w.nvfp4_bytes:,} NVFP4), of which {w.block_linears_bytes:,} bytes of block linears (what tensor mode splits)"
        )
        table.caption_justify = "left"
    for col in ("rank" if not each else "local rank", "heads", "tokens", "local segments", "weights held"):
        table.add_column(col)
    for i, r in enumerate(plan.ranks):
        table.add_row(
            str(r.rank), f"{len(r.heads)}  [{r.heads}]", f"{len(r.tokens)}  [{r.tokens}]",
            "  ".join(f"{s.kind}[{s.start}:{s.stop}]" for s in r.segments), format_bytes(w.per_rank[i]) if w else "",
        )
    console.print(table)
    for title, columns, rows in mode_of(plan.mode).plan_tables([r.tensor for r in plan.ranks]):
        extra = Table(title=title, title_justify="left")
        for column in columns:
            extra.add_column(column)
        for row in rows:
            extra.add_row(*row)
        console.print(extra)


def _render_groups(plan: ParallelPlan, console: Console) -> None:
    """The layout's groups (only when there is more than one): which global ranks, what each runs."""
    layout = plan.layout
    if len(layout.groups) == 1:
        return
    table = Table(title=f"rank layout: {layout.describe()}", title_justify="left")
    for col in ("replica", "CFG branch", "global ranks", "runs every step"):
        table.add_column(col)
    for g in layout.groups:
        branch = str(g.branch) if layout.cfg_parallel else "-"
        table.add_row(str(g.replica), branch, ", ".join(map(str, g.ranks)), " + ".join(g.runs) + f" ({plan.mode.value} over {len(g.ranks)})")
    if layout.cfg_parallel:
        table.caption = ("each step: both branches' velocities, then one cfg_exchange per replica gives every rank the other "
                         "branch's velocity for its latent rows; the rank-level table below is each group's partition "
                         "(the prompt's sequence; the negative prompt's splits the same way by its own length)")
        table.caption_justify = "left"
    console.print(table)


def plan(
    count: Annotated[Optional[int], typer.Argument(help="Number of ranks (GPUs). Default: H3_WORLD_SIZE, else every visible GPU, else 1.", show_default=False)] = None,
    mode: Annotated[str, typer.Option("--mode", help=f"Distributed mode: {', '.join(Mode)}.")] = "ulysses",
    preset: options.Preset = "h3",
    width: options.Width = None,
    height: options.Height = None,
    frames: options.Frames = None,
    text_tokens: Annotated[Optional[int], typer.Option("--text-tokens", help="Prompt length in tokens (default: the preset's).")] = None,
    cfg_parallel: Annotated[bool, typer.Option("--cfg-parallel", help="Lay the ranks out as two CFG halves (prompt | negative prompt), as h3 generate --cfg-parallel does.")] = False,
    replicas: options.Replicas = 1,
    keyframes: Annotated[Optional[str], typer.Option("--keyframes", metavar="first,last", help="FL2VA: plan with these keyframes (first, last or first,last): one condition frame each after the text, and the prompt presented after their vision blocks (at the --width/--height canvas, else the preset's).", show_default=False)] = None,
    memory: Annotated[bool, typer.Option("--memory", help="Also dry-run every rank's own code on fake tensors and print its predicted GPU peak (sm_90 and sm_120; seconds at H3's shapes).")] = False,
    arch: Annotated[Optional[list[str]], typer.Option("--arch", help="With --memory: the GPU path to predict for, sm_90 (Hopper, dequant) or sm_120 (Blackwell, fp4); repeat for both (default both).", show_default=False)] = None,
    decoded_weights: options.DecodedWeights = "auto",
    lora: options.Lora = None,
    json: options.Json = False,
) -> None:
    """Print the rank layout's groups and, per rank of a group, the heads, token interval, clipped segments and (tensor mode) NVFP4 slices."""
    if not memory and (arch or decoded_weights != "auto"):
        raise ConfigError(f"{'--arch' if arch else '--decoded-weights'} says what --memory predicts for; add --memory")
    roles = _roles(keyframes)
    from h3core.lora import parse_lora

    loras = tuple(parse_lora(text) for text in lora or ())
    if loras and not memory:
        raise ConfigError("--lora counts adapters in the dry run's prediction: give it with --memory")
    if memory:
        from h3core.generate.dryrun import ARCHS, plan_memory

        found = plan_memory(preset, count, Mode(mode), archs=arch or list(ARCHS), width=width, height=height, frames=frames, text_tokens=text_tokens,
                            cfg_parallel=cfg_parallel, replicas=replicas, decoded_weights=decoded_weights, keyframes=roles, loras=loras)
        out = Output(json)
        out.result(found, lambda console: (_render(found.plan, console), _render_memory(found, console)))
        if found.skipped:
            raise typer.Exit(1)
        return
    if roles:
        from h3core.generate.dryrun import planned_preset

        result = planned_preset(preset, count, Mode(mode), width=width, height=height, frames=frames, text_tokens=text_tokens,
                                cfg_parallel=cfg_parallel, replicas=replicas, keyframes=roles)
    else:
        result = ParallelPlan.for_preset(preset, count, Mode(mode), width=width, height=height, frames=frames, text_tokens=text_tokens,
                                         cfg_parallel=cfg_parallel, replicas=replicas)
    Output(json).result(result, lambda console: _render(result, console))


def _roles(keyframes: str | None) -> tuple[str, ...]:
    """`--keyframes first,last` -> the anchors in packed order (a role other than first/last is one line)."""
    from h3core.generate.keyframes import keyframe_roles

    if keyframes is None:
        return ()
    given = [r.strip() for r in keyframes.split(",") if r.strip()]
    if len(set(given)) != len(given):
        raise ConfigError(f"--keyframes {keyframes}: a role given twice; say first, last or first,last")
    return keyframe_roles({role: Path(role) for role in given})


def _render_memory(found, console: Console) -> None:  # type: ignore[no-untyped-def]
    """Each architecture's dry run: per rank, the predicted device peaks and what the rank holds."""
    decoded = found.plan.decoded
    if decoded is not None:
        held = "held" if decoded.held else "not held"
        console.print(f"decoded weights (where NVFP4 linears decode every forward: Hopper, the CPU; first architecture): {held}: {decoded.count} NVFP4 linears "
                      f"({', '.join(decoded.linears)}), {format_bytes(max(decoded.bytes_per_rank, default=0))} per rank; {decoded.reason}")
    for phase, parts in found.keyframe_encode.items():
        console.print(f"rank 0 before the denoiser loads (keyframes), {phase}: {format_bytes(sum(parts.values()))} at least ("
                      + ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items()) + ")")
    for a in found.adapters:
        console.print(f"LoRA {a.name} ({a.format}, x{a.scale:g}, {a.layers} linears, rank {'/'.join(map(str, a.ranks))}): "
                      f"{' · '.join(format_bytes(b) for b in a.bytes_per_rank)} per rank (counted in the peaks below)")
    if found.decode is not None:
        d = found.decode
        console.print(f"decode after denoising, shared out over {d.ranks} rank(s) ({d.windows} windows x {d.tiles_per_window} tiles, "
                      f"{format_bytes(d.unit_bytes)} kept per tile): " + " · ".join(f"r{r} {format_bytes(b)}" for r, b in enumerate(d.rank_bytes))
                      + f" (each with the VAEs' {format_bytes(d.weights_bytes)}; rank 0 also the clip, the last rank the audio)")
    if found.skipped:
        console.print(line(styled("no dry run here: ", "red"), styled(found.skipped, "red")))
        return
    for run in found.dry_runs:
        table = Table(title=f"predicted GPU memory · {run.arch} · {run.mode} · {run.world_size} rank(s) · dry run of {run.steps_simulated - 1} steps in {run.seconds:.1f} s",
                      title_justify="left")
        for col in ("rank", "peak", "sampling peak", "load peak", "held after load", "NVFP4 path", "host syncs per step"):
            table.add_column(col)
        for r in run.ranks:
            ranks = ", ".join(map(str, [r.rank, *r.same_as]))
            syncs = "; ".join(f"{s.where.split()[-1]} x{s.count // max(1, len(r.live_after_steps))}" for s in r.host_syncs if s.phase == "sampling") or "none"
            table.add_row(ranks, format_bytes(r.peak_total), format_bytes(r.peak_sampling), format_bytes(r.peak_load),
                          format_bytes(r.resident_after_load), ", ".join(r.nvfp4_paths) or "-", syncs)
        console.print(table)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
