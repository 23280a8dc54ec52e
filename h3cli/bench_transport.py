"""`h3 bench-transport`: the Ulysses all-to-all and distributed attention, no weights loaded."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TimeElapsedColumn
from rich.table import Table

from h3cli import options
from h3cli.output import LiteralConsole, Output, line, progress_bar, styled, text_column
from h3core.reports.units import format_bytes


def _render(report: Any, console: Console) -> None:
    from h3core.generate.report import per_rank_summary

    cfg = report.config
    table = Table(
        title=(
            f"bench-transport · {cfg.world_size} rank(s) · {report.backend} on {cfg.device} · {cfg.dtype} · "
            f"{cfg.tokens} tokens ({'/'.join(map(str, report.tokens_per_rank))}) · "
            f"{cfg.heads}x{cfg.head_dim} heads ({'/'.join(map(str, report.heads_per_rank))}) · "
            f"median of {cfg.iters} after {cfg.warmup} warm-up"
        ),
        title_justify="left",
    )
    for column in ("phase", "median ms (slowest rank)", "sent per rank", "GB/s"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for name, phase in report.phases.items():
        label = f"attention ({cfg.attention})" if name == "attention" else name.replace("_", " ")
        gbps = f"{phase.gb_per_s:.2f}" if phase.gb_per_s is not None else "-"
        table.add_row(label, f"{phase.median_s * 1e3:.3f}", format_bytes(max(phase.bytes_sent_per_rank)), gbps)
    console.print(table)
    exact = styled("exact") if report.identity_exact and report.blocks_exact and report.overlap_exact else styled("NOT EXACT", "red")
    console.print(line("seq->head->seq identity, RoPE-into-blocks vs seq->head of finished q|k|v, overlapped vs whole attention: ", exact))
    if report.overlap is not None:
        _render_overlap(report.overlap, console)
    if report.config.time_attention:
        console.print(f"attention kernel that ran: {per_rank_summary(report.attention_kernels)}")
    if report.ratio is None:
        console.print("ratio: n/a at one rank (nothing moves)")
    else:
        verdict = styled("within", "green") if report.ratio <= report.target_ratio else styled("above", "yellow")
        wire = report.wire_s * 1e3
        console.print(line(
            f"h3 round trip {report.round_trip_s * 1e3:.1f} ms = {report.ratio:.2f} x the wire ({wire:.1f} ms: "
            "plain all_to_all_single of the same bytes, buffers allocated once), ", verdict, f" target {report.target_ratio}",
        ))
        console.print(
            f"  round trip = RoPE and v GEMM into the send blocks - the same on one rank + seq->head + head->seq; "
            f"seq->head of a stacked q|k|v (pack + all-to-all) + head->seq: {report.packed_ratio:.2f} x; "
            f"the wire into fresh receive buffers: {report.fresh_ratio:.2f} x",
            soft_wrap=True,
        )
    if cfg.device == "cpu":
        console.print(f"CPU allocator of the ranks: {report.cpu_allocator} (H3_CPU_ALLOCATOR)")
    if cfg.report_file is not None:
        console.print(f"report: {cfg.report_file}")


def _render_overlap(o: Any, console: Console) -> None:
    """Whole vs overlapped Ulysses attention, and how much of the overlapped all-to-alls stayed exposed."""
    in_flight = f", {o.comm_in_flight_s * 1e3:.2f} ms in flight" if o.comm_in_flight_s is not None else " (time in flight: not timed on CUDA)"
    console.print(
        f"overlap ({o.groups} head groups): attention path {o.overlapped_s * 1e3:.2f} ms overlapped vs {o.whole_s * 1e3:.2f} ms whole "
        f"(median of per-iteration ratios {o.ratio:.2f} x, {o.ratio_range[0]:.2f}-{o.ratio_range[1]:.2f}); all-to-alls {o.comm_exposed_s * 1e3:.2f} ms exposed{in_flight}, against the whole path's "
        f"{o.comm_whole_s * 1e3:.2f} ms: {o.hidden_s * 1e3:.2f} ms hidden",
        soft_wrap=True,
    )


@contextmanager
def _progress(total_label: str) -> Iterator[Callable[[Any], None]]:
    """A transient bar on stderr fed by rank 0's ('iter', done, total) messages."""
    with progress_bar(LiteralConsole(stderr=True), text_column(total_label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:

        def update(message: Any) -> None:
            if isinstance(message, tuple) and message[0] == "iter":
                bar(completed=message[1], total=message[2])

        yield update


def bench_transport(
    count: Annotated[Optional[int], typer.Argument(help="Ranks. Default: H3_WORLD_SIZE, else every visible GPU, else 1.", show_default=False)] = None,
    attention: Annotated[str, typer.Argument(help="Attention backend: sdpa, math, sage2 or flash.")] = "sdpa",
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Packed sequence length (default: H3 at the video size).")] = None,
    width: options.Width = None,
    height: options.Height = None,
    frames: options.Frames = None,
    heads: Annotated[int, typer.Option("--heads", help="Attention heads.")] = 56,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Width of one head.")] = 128,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="fp32, bf16 or fp16 (or torch's names: float32, bfloat16, float16); default: bf16 on CUDA, fp32 on CPU.")] = None,
    iters: Annotated[int, typer.Option("--iters", help="Timed iterations (the median is reported).")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed iterations first.")] = 3,
    skip_attention: Annotated[bool, typer.Option("--skip-attention", help="Time the transport only (attention at H3 sizes takes minutes on a CPU).")] = False,
    overlap_groups: Annotated[int, typer.Option("--overlap-groups", help="Head groups of the overlapped attention path timed beside the whole one (--ulysses-overlap).")] = 2,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    output: Annotated[Optional[Path], typer.Option("--output", help="Report file (*.json) or folder. Default: H3_DISTRIBUTED_BENCHMARK, else none.", show_default=False)] = None,
    json: options.Json = False,
) -> None:
    """Time Ulysses seq->head, attention and head->seq on random q|k|v against the wire (a plain all-to-all of the same bytes)."""
    from h3core.bench.transport import TransportBenchConfig, run_transport_benchmark

    cfg = TransportBenchConfig.build(
        world_size=count, attention=attention, tokens=tokens, width=width, height=height, frames=frames, heads=heads,
        head_dim=head_dim, device=device, dtype=dtype, iters=iters, warmup=warmup, time_attention=not skip_attention, overlap_groups=overlap_groups, output=output,
    )
    with _progress(f"bench-transport {cfg.world_size}x") as on_progress:
        report = run_transport_benchmark(cfg, on_progress)
    Output(json).result(report, lambda console: _render(report, console))  # None on a torchrun rank other than 0


def register(app: typer.Typer) -> None:
    app.command("bench-transport")(bench_transport)
