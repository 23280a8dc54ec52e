"""`h3 bench-transport`: the Ulysses transport and distributed attention, without H3 weights.

Every rank builds random q|k|v for its token rows in H3's real head layout (`[S_loc, 3, H, Dh]`,
56 x 128 by default), sharded as h3 shards them (`token_spans`, `head_spans`), and times, per
iteration and in this order:

1. `seq_to_head` of the fused q|k|v (one all-to-all, as Ulysses attention calls it),
2. attention on the rank's heads over the whole sequence (`attend`, the chosen backend),
3. `head_to_seq` of the attention output,
4. the baseline: a plain `all_to_all_single` moving exactly the bytes of (1) with the same
   per-peer split sizes, from a ready contiguous buffer into a freshly allocated one,
5. the same for the bytes of (3).

Each timed region starts after a barrier (so no rank's figure includes waiting for a late peer)
and ends when the device has finished (`Stopwatch`). Per phase, each rank takes the median over
the iterations after warm-up; the phase's figure is the **maximum over ranks** of those medians
(the slowest rank sets the pace of a collective). Ratio = (seq->head + head->seq) / (baseline of
the q|k|v bytes + baseline of the output bytes): what h3's packing, unpacking and bookkeeping
cost on top of the transport itself. Before timing, each rank checks once that
`head_to_seq(seq_to_head(x))` gives `x` back bit for bit.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from h3core.attention import check_backend
from h3core.config import preset
from h3core.device import check_world_size_fits, dtype_name, resolve_device
from h3core.environment import BENCHMARK, env_str
from h3core.errors import ConfigError
from h3core.partition import head_spans, token_spans
from h3core.report import Versions
from h3core.validation import UserRequest

TARGET_RATIO = 1.15
PHASES = ("seq_to_head", "attention", "head_to_seq", "baseline_qkv", "baseline_out")


class TransportBenchConfig(UserRequest):
    """What `h3 bench-transport` measures (all sizes already resolved; a bad value is one ConfigError line)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    FLAGS: ClassVar[dict[str, str]] = {"world_size": "COUNT", "time_attention": "--skip-attention"}

    world_size: int = Field(ge=1, description="Ranks (one per GPU, or Gloo ranks on the CPU).")
    attention: str = Field("sdpa", description="Attention backend: sdpa, math, sage2 or flash.")
    tokens: int = Field(ge=1, description="Length of the packed sequence.")
    heads: int = Field(56, ge=1, description="Attention heads (H3: 56).")
    head_dim: int = Field(128, ge=1, description="Width of one head (H3: 128).")
    device: str = Field(description="Resolved device type: 'cpu' or 'cuda'.")
    dtype: str = Field(description="Compute dtype: fp32, bf16 or fp16.")
    iters: int = Field(20, ge=1, description="Timed iterations per phase.")
    warmup: int = Field(3, ge=0, description="Untimed iterations before them.")
    time_attention: bool = Field(True, description="Run and time the attention phase (off: transport only).")
    seed: int = Field(default=0, description="Seed of the random q|k|v (rank r uses seed + r).")

    @classmethod
    def build(
        cls,
        *,
        world_size: int,
        attention: str = "sdpa",
        tokens: int | None = None,
        width: int | None = None,
        height: int | None = None,
        frames: int | None = None,
        heads: int = 56,
        head_dim: int = 128,
        device: str = "auto",
        dtype: str | None = None,
        iters: int = 20,
        warmup: int = 3,
        time_attention: bool = True,
    ) -> "TransportBenchConfig":
        """Resolve and check a request before any rank exists (each problem is one ConfigError)."""
        from h3core.device import compute_dtype

        device_type = resolve_device(device)
        if tokens is not None and (width or height or frames):
            raise ConfigError("give either --tokens or --width/--height/--frames, not both")
        if tokens is None:
            h3 = preset("h3")
            tokens = h3.num_tokens(width or h3.width, height or h3.height, frames or h3.frames, h3.text_tokens)
        if iters < 1 or warmup < 0:
            raise ConfigError(f"--iters must be at least 1 and --warmup at least 0 (got {iters}, {warmup})")
        check_world_size_fits(world_size, device_type)
        token_spans(tokens, world_size)  # raise PartitionError before spawning
        head_spans(heads, world_size)
        if time_attention:
            check_backend(attention, device_type)
        cfg = cls(
            world_size=world_size, attention=attention, tokens=tokens, heads=heads, head_dim=head_dim,
            device=device_type, dtype=dtype_name(compute_dtype(device_type, dtype)), iters=iters,
            warmup=warmup, time_attention=time_attention,
        )
        cfg.check_memory()
        return cfg

    def check_memory(self) -> None:
        """Refuse (one line) what the ranks of this machine cannot hold (`h3core.limits`)."""
        from h3core.device import compute_dtype
        from h3core.limits import capacity, check_memory, transport_need

        need = transport_need(self.tokens, self.heads, self.head_dim, self.world_size, self.device,
                              compute_dtype(self.device, self.dtype), self.attention if self.time_attention else None)
        check_memory(need, capacity(self.device, self.world_size), "--tokens (or --width/--height/--frames), --heads or --head-dim")


class PhaseTiming(BaseModel):
    """One phase: per-rank medians, the figure that counts (slowest rank), bytes and bandwidth."""

    median_s_per_rank: list[float] = Field(description="Each rank's median over the timed iterations.")
    median_s: float = Field(description="Max over ranks of the per-rank medians.")
    bytes_sent_per_rank: list[int] = Field(description="Bytes each rank sends to other ranks per call.")
    gb_per_s: float | None = Field(description="Largest per-rank bytes sent / median_s, in 1e9 B/s (None without traffic).")


class TransportReport(BaseModel):
    """The result of `h3 bench-transport`, as printed by --json and written to the report file."""

    command: str = "bench-transport"
    config: TransportBenchConfig
    backend: str = Field(description="Process-group backend: gloo, nccl, or none at one rank.")
    tokens_per_rank: list[int]
    heads_per_rank: list[int]
    qkv_fused: bool = Field(default=True, description="q|k|v travel in one all-to-all ([S_loc, 3, H, Dh]).")
    identity_exact: bool = Field(description="head_to_seq(seq_to_head(x)) == x bit for bit on every rank.")
    phases: dict[str, PhaseTiming]
    transport_s: float = Field(description="seq_to_head + head_to_seq (each the slowest rank's median).")
    baseline_s: float = Field(description="The two plain all_to_all_single of the same byte counts.")
    ratio: float | None = Field(description="transport_s / baseline_s (None at one rank: nothing moves).")
    target_ratio: float = TARGET_RATIO
    timing: str = Field(
        default="barrier before each timed region; device-synchronised; per-rank median over timed iterations; max over ranks",
        description="How the figures were taken.",
    )
    versions: Versions


# --- the rank side --------------------------------------------------------------------------------


def _bench_rank(ctx: Any, cfg: TransportBenchConfig) -> dict[str, Any]:
    """Runs on every rank: builds the shards, checks the identity, times every phase."""
    import torch

    from h3core.collectives import CommStats, head_to_seq, seq_to_head
    from h3core.device import compute_dtype
    from h3core.launch import maybe_inject_fault

    dtype = compute_dtype(ctx.device.type, cfg.dtype)
    tokens, heads = token_spans(cfg.tokens, ctx.world_size), head_spans(cfg.heads, ctx.world_size)
    local_heads = len(heads[ctx.rank])
    generator = torch.Generator(device=ctx.device).manual_seed(cfg.seed + ctx.rank)
    # qkv: [S_loc, 3, H, Dh], this rank's token rows of the fused projection output.
    qkv = torch.randn(len(tokens[ctx.rank]), 3, cfg.heads, cfg.head_dim, generator=generator, device=ctx.device, dtype=dtype)
    # stand_in_out: [S, H_loc, Dh], what attention would return when it is not timed.
    stand_in_out = torch.randn(cfg.tokens, local_heads, cfg.head_dim, generator=generator, device=ctx.device, dtype=dtype)
    identity = bool(torch.equal(head_to_seq(seq_to_head(qkv, tokens, heads, ctx.group), tokens, heads, ctx.group), qkv))
    baseline_qkv = _baseline(ctx, qkv, [len(tokens[ctx.rank]) * 3 * len(h) * cfg.head_dim for h in heads],
                             [len(t) * 3 * local_heads * cfg.head_dim for t in tokens])
    baseline_out = _baseline(ctx, stand_in_out, [len(t) * local_heads * cfg.head_dim for t in tokens],
                             [len(tokens[ctx.rank]) * len(h) * cfg.head_dim for h in heads])
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    stats = CommStats()
    total = cfg.warmup + cfg.iters
    for step in range(total):
        maybe_inject_fault("iter", ctx.rank, step)
        timed = step >= cfg.warmup
        by_head = _timed(ctx, samples["seq_to_head"], timed, lambda: seq_to_head(qkv, tokens, heads, ctx.group, stats))
        out = stand_in_out
        if cfg.time_attention:
            out = _timed(ctx, samples["attention"], timed, lambda: _attend(by_head, cfg.attention))
        _timed(ctx, samples["head_to_seq"], timed, lambda: head_to_seq(out, tokens, heads, ctx.group, stats))
        _timed(ctx, samples["baseline_qkv"], timed, baseline_qkv)
        _timed(ctx, samples["baseline_out"], timed, baseline_out)
        ctx.report(("iter", step + 1, total))
    calls = max(1, total)
    per_call = {kind: counts.bytes_sent // calls for kind, counts in stats.kinds.items()}
    return {
        "identity": identity,
        "samples": samples,
        "bytes": {
            "seq_to_head": per_call.get("seq_to_head", 0),
            "head_to_seq": per_call.get("head_to_seq", 0),
            "baseline_qkv": per_call.get("seq_to_head", 0),
            "baseline_out": per_call.get("head_to_seq", 0),
            "attention": 0,
        },
    }


def _attend(by_head: Any, backend: str) -> Any:
    from h3core.attention import attend

    # by_head: [S, 3, H_loc, Dh] -> q, k, v: [S, H_loc, Dh] each -> out: [S, H_loc, Dh]
    return attend(by_head[:, 0], by_head[:, 1], by_head[:, 2], backend)


def _baseline(ctx: Any, x: Any, send_sizes: list[int], recv_sizes: list[int]) -> Callable[[], Any]:
    """A plain all_to_all_single of x's bytes with h3's split sizes (a no-op at one rank)."""
    import torch.distributed as dist

    flat = x.contiguous().view(-1)
    even = len(set(send_sizes)) == 1 and len(set(recv_sizes)) == 1

    def run() -> Any:
        if ctx.group is None:
            return flat
        recv = flat.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, flat, None if even else recv_sizes, None if even else send_sizes, group=ctx.group)
        return recv

    return run


def _timed(ctx: Any, samples: list[float], keep: bool, work: Callable[[], Any]) -> Any:
    """Barrier, then time `work` to device completion; the seconds go to `samples` when `keep`."""
    import torch.distributed as dist

    from h3core.device import Stopwatch, synchronize

    if ctx.group is not None:
        dist.barrier(group=ctx.group)
    synchronize(ctx.device)
    with Stopwatch(ctx.device) as watch:
        result = work()
    if keep:
        samples.append(watch.seconds)
    return result


# --- the parent side --------------------------------------------------------------------------------


def run_transport_benchmark(
    cfg: TransportBenchConfig, on_progress: Callable[[Any], None] | None = None
) -> TransportReport | None:
    """Start `cfg.world_size` ranks, benchmark, and summarise (see the module docstring).

    Under torchrun every rank calls this; rank 0 gets the report, the other ranks None.
    """
    from h3core.launch import World

    with World(cfg.world_size, cfg.device, on_progress=on_progress) as world:
        per_rank = world.run(_bench_rank, cfg)
        backend, is_main = world.backend, world.is_main
    return _summarise(cfg, backend, per_rank) if is_main else None


def _summarise(cfg: TransportBenchConfig, backend: str, per_rank: list[dict[str, Any]]) -> TransportReport:
    phases: dict[str, PhaseTiming] = {}
    for phase in PHASES:
        if phase == "attention" and not cfg.time_attention:
            continue
        medians = [statistics.median(r["samples"][phase]) for r in per_rank]
        sent = [int(r["bytes"][phase]) for r in per_rank]
        slowest = max(medians)
        gbps = max(sent) / slowest / 1e9 if max(sent) and slowest > 0 else None
        phases[phase] = PhaseTiming(median_s_per_rank=medians, median_s=slowest, bytes_sent_per_rank=sent, gb_per_s=gbps)
    transport = phases["seq_to_head"].median_s + phases["head_to_seq"].median_s
    baseline = phases["baseline_qkv"].median_s + phases["baseline_out"].median_s
    moves = cfg.world_size > 1
    return TransportReport(
        config=cfg,
        backend=backend,
        tokens_per_rank=[len(s) for s in token_spans(cfg.tokens, cfg.world_size)],
        heads_per_rank=[len(s) for s in head_spans(cfg.heads, cfg.world_size)],
        identity_exact=all(r["identity"] for r in per_rank),
        phases=phases,
        transport_s=transport,
        baseline_s=baseline,
        ratio=transport / baseline if moves and baseline > 0 else None,
        versions=Versions.collect(),
    )


def report_path(output: str | Path | None, cfg: TransportBenchConfig) -> Path | None:
    """Where the JSON report goes: --output, else H3_DISTRIBUTED_BENCHMARK, else nowhere.

    A path ending in .json is the file itself (the seed's variable); anything else is a folder
    that receives `bench-transport-{N}x-{ATTN}.json`.
    """
    chosen = str(output) if output is not None else env_str(BENCHMARK)
    if chosen is None:
        return None
    path = Path(chosen)
    if path.suffix.lower() == ".json":
        return path
    attention = cfg.attention if cfg.time_attention else "transport-only"
    return path / f"bench-transport-{cfg.world_size}x-{attention}.json"


def bytes_label(n: int) -> str:
    """1234567 -> '1.23 MB' (decimal units, as bandwidth is quoted)."""
    if n == 0:
        return "0"
    exponent = min(int(math.log10(n) // 3), 4)
    return f"{n / 10 ** (3 * exponent):.2f} {['B', 'kB', 'MB', 'GB', 'TB'][exponent]}"
