"""`h3 bench-transport`: the Ulysses transport and distributed attention, without H3 weights,
against the physical limit: the same bytes through a plain all-to-all.

Every rank builds random attention inputs for its token rows in H3's real head layout (56 x 128 by
default) as the model has them just before RoPE (q and k normalised; v still to be computed by its
NVFP4 GEMM: `ProjectedQKV` with a `LinearHeads` v, as the model's dequant paths build it), sharded as
h3 shards them (`token_spans`, `head_spans`), and times, per iteration and in this order:

1. `finish_one_rank`: RoPE of q and k into new tensors and v's GEMM into a new tensor: what one
   rank does before attention anyway;
2. `finish_into_blocks`: the same RoPE written straight into the all-to-all's send blocks and v's
   GEMM writing there, one GEMM per peer (`ProjectedQKV.write` into `send_blocks`): what Ulysses
   attention does instead;
3. `seq_to_head`: the all-to-all of those blocks into `[S, 3, H_loc, Dh]` (`exchange_blocks`);
4. `attention` on the rank's heads over the whole sequence (the chosen backend; optional);
5. `head_to_seq` of the attention output back to `[S_loc, H, Dh]` (all-to-all + unpack);
6. `seq_to_head_packed`: `seq_to_head` of a ready contiguous `[S_loc, 3, H, Dh]` (the generic call:
   pack copy + all-to-all), for callers that hold q|k|v stacked;
7. `wire_qkv`, `wire_out`: the wire, a plain `all_to_all_single` moving exactly the bytes of (3)
   and (5), with the same per-peer split sizes, between buffers allocated once;
8. `fresh_qkv`, `fresh_out`: the same into a freshly allocated receive buffer (what the previous
   version of this benchmark used as its baseline: on a CPU its page faults cost more than the copy).

9. `attend_whole`, `attend_overlapped` (with attention only): Ulysses attention whole, as the model runs
   it (send blocks written, seq->head, attention, head->seq: `attend_whole`) and overlapped in
   `--overlap-groups` head groups (`attend_in_groups`, `--ulysses-overlap`), in alternating order;
   inside them `comm_whole` (the time in the whole path's two all-to-alls: all of it exposed),
   `comm_exposed` (the overlapped path's time in its all-to-alls' own code: starting them, blocked
   waiting, unpacking the returns) and, on the CPU, `comm_in_flight` (its all-to-alls' time from
   start to arrival, summed). Hidden = comm_whole - comm_exposed (what overlap took off the rank's
   path); overlap ratio = the median of the per-iteration overlapped / whole.

h3's round trip, per iteration = (2) - (1) + (3) + (5): everything Ulysses adds to one rank's
attention path; the wire = (7). (1) and (2) swap places every other iteration (`_iteration`). v's
GEMM is in both (1) and (2), so only what Ulysses changes about it counts (per-peer GEMMs, strided
output rows). Its input is `V_INPUT_WIDTH` wide instead of the model's hidden width: the GEMM stays
cheap next to the transport (at 7168 it would take seconds per rank on a CPU, equally in (1) and
(2), and bury the difference in noise) while its output, what the layout changes, is the model's.

Each timed region starts after a barrier (no rank's figure includes waiting for a late peer) and
ends when the device has finished (`Stopwatch`). A phase takes, in one iteration, as long as its
**slowest rank** (the collective that follows waits for it); a figure is the median over the
iterations after warm-up of those per-iteration times (of their signed sums for the round trip).
Where ranks share CPU cores, one rank's own time depends on whom the scheduler ran first (81-204 ms
for the same work at 4 ranks on 2 cores); the slowest rank's is the phase's. Ratio = h3's round trip
/ the wire; targets (this machine's CPUs or GPUs, one run): <= 1.3 up to 4 ranks, <= 1.5 above.
Before timing, each rank checks that `head_to_seq(seq_to_head(x))` gives `x` back and that the
blocks written by RoPE arrive bit for bit as `seq_to_head` of the finished q|k|v.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3core import settings
from h3core.errors import ConfigError
from h3core.model import attention
from h3core.model.attention import SdpaChoices, attend, check_backend, scores_bytes
from h3core.model.config import ModelConfig, preset
from h3core.nvfp4.linear import NVFP4Linear
from h3core.parallel import overlap
from h3core.parallel.collectives import CommStats, FlightLog, Scratch, SendBlocks, exchange_blocks, head_to_seq, send_blocks, seq_to_head
from h3core.parallel.modes.ulysses import Exchange, LinearHeads, ProjectedQKV, attend_in_groups, attend_whole
from h3core.parallel.partition import head_groups, head_spans, token_spans
from h3core.reports.outputs import Outputs
from h3core.reports.schema import Versions, report_json
from h3core.runtime import cpu_memory
from h3core.runtime.context import RankContext
from h3core.runtime.device import Stopwatch, check_world_size_fits, compute_dtype, dtype_name, resolve_device, synchronize, visible_gpu_count
from h3core.runtime.faults import maybe_inject_fault
from h3core.runtime.limits import PROCESS_BYTES, MemoryNeed, capacity, check_memory
from h3core.runtime.world import World
from h3core.settings import UserRequest
from h3core.span import Span

PHASES = (
    "finish_one_rank", "finish_into_blocks", "seq_to_head", "attention", "head_to_seq",
    "seq_to_head_packed", "wire_qkv", "wire_out", "fresh_qkv", "fresh_out",
    "attend_whole", "attend_overlapped", "comm_whole", "comm_exposed", "comm_in_flight",
)
OVERLAP_PHASES = PHASES[-5:]
"""Timed with attention only (overlap hides the all-to-alls behind it)."""
ROUND_TRIP = {"finish_into_blocks": 1, "finish_one_rank": -1, "seq_to_head": 1, "head_to_seq": 1}
"""h3's round trip per iteration, as signed sums of phases: what Ulysses adds to one rank's attention."""
PACKED_ROUND_TRIP = {"seq_to_head_packed": 1, "head_to_seq": 1}
WIRE = {"wire_qkv": 1, "wire_out": 1}
FRESH = {"fresh_qkv": 1, "fresh_out": 1}
V_INPUT_WIDTH = 64
"""Input width of the benchmark's v GEMM (NVFP4, 64 = four 16-element blocks; see the module docstring)."""


def target_ratio(world_size: int) -> float:
    """h3 / wire the transport must stay within: 1.3 up to 4 ranks, 1.5 above (more, smaller blocks)."""
    return 1.3 if world_size <= 4 else 1.5


def _check_heads(h3: ModelConfig, heads: int, head_dim: int) -> None:
    """The heads a model can have, by the model's own rule (`ModelConfig`: NVFP4 blocks follow
    heads, 3-axis RoPE): what `h3 generate` could never run is refused here too, not inside a rank."""
    flags = {"num_heads": "--heads", "head_dim": "--head-dim"}
    try:
        ModelConfig.model_validate({**h3.model_dump(), "num_heads": heads, "head_dim": head_dim,
                                    "rope_freq_dim": max(1, rotary_half(head_dim) // 3)})  # the benchmark's RoPE at that width
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        flag = flags.get(field, "--head-dim")
        value = heads if flag == "--heads" else head_dim
        reason = str(first.get("ctx", {}).get("error") or first["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"{flag} {value}: {reason}; H3's heads are 56 x 128") from None


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
    overlap_groups: int = Field(overlap.GROUPS, ge=2, description="Head groups of the overlapped path (attend_overlapped; h3core.parallel.overlap).")
    seed: int = Field(default=0, description="Seed of the random q|k|v (rank r uses seed + r).")
    report_file: Path | None = Field(None, description="Where the JSON report is written (--output, else H3_DISTRIBUTED_BENCHMARK; None: nowhere).")

    @classmethod
    def build(
        cls,
        *,
        world_size: int | None,
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
        overlap_groups: int = overlap.GROUPS,
        output: Path | None = None,
    ) -> "TransportBenchConfig":
        """Resolve and check a request before any rank exists (each problem is one ConfigError).
        `world_size` None: H3_WORLD_SIZE, else every visible GPU, else 1."""
        device_type = resolve_device(device)
        world_size = settings.world_size(world_size, visible_gpu_count)
        if tokens is not None and (width or height or frames):
            raise ConfigError("give either --tokens or --width/--height/--frames, not both")
        size = settings.SizeFlags(width=width, height=height, frames=frames)  # as h3 generate checks them
        h3 = preset("h3")
        if tokens is None:
            tokens = h3.num_tokens(*size.or_defaults(h3.width, h3.height, h3.frames), h3.text_tokens)
        if heads >= 1 and head_dim >= 1:  # (below 1: the fields' own line)
            _check_heads(h3, heads, head_dim)
        if iters < 1 or warmup < 0:
            raise ConfigError(f"--iters must be at least 1 and --warmup at least 0 (got {iters}, {warmup})")
        if overlap_groups < 2:
            raise ConfigError(f"--overlap-groups must be at least 2 (got {overlap_groups}): one group is the whole all-to-all")
        check_world_size_fits(world_size, device_type)
        token_spans(tokens, world_size)  # raise PartitionError before spawning
        head_spans(heads, world_size)
        if time_attention:
            check_backend(attention, device_type, head_dim=head_dim, dtype=compute_dtype(device_type, dtype))
        cfg = cls(
            world_size=world_size, attention=attention, tokens=tokens, heads=heads, head_dim=head_dim,
            device=device_type, dtype=dtype_name(compute_dtype(device_type, dtype)), iters=iters,
            warmup=warmup, time_attention=time_attention, overlap_groups=overlap_groups,
            report_file=report_file(settings.benchmark_path(output), world_size, attention if time_attention else "transport-only"),
        )
        cfg.check_memory()
        return cfg

    def check_memory(self) -> None:
        """Refuse (one line) what the ranks of this machine cannot hold (`h3core.runtime.limits`)."""
        need = transport_need(self.tokens, self.heads, self.head_dim, self.world_size, self.device,
                              compute_dtype(self.device, self.dtype), self.attention if self.time_attention else None)
        check_memory(need, capacity(self.device, self.world_size), "--tokens (or --width/--height/--frames), --heads or --head-dim")


class PhaseTiming(BaseModel):
    """One phase: per-rank medians, the figure that counts (slowest rank), bytes and bandwidth."""

    median_s_per_rank: list[float] = Field(description="Each rank's median over the timed iterations.")
    median_s: float = Field(description="Median over the timed iterations of the slowest rank's time in each.")
    bytes_sent_per_rank: list[int] = Field(description="Bytes each rank sends to other ranks per call.")
    gb_per_s: float | None = Field(description="Largest per-rank bytes sent / median_s, in 1e9 B/s (None without traffic).")


class OverlapTiming(BaseModel):
    """Ulysses attention whole vs overlapped (`--overlap-groups` head groups), timed alternately in one run."""

    groups: int = Field(description="Head groups the overlapped all-to-alls were split into (capped at the fewest heads a rank holds).")
    whole_s: float = Field(description="attend_whole: median over iterations of the slowest rank.")
    overlapped_s: float = Field(description="attend_overlapped: the same.")
    ratio: float = Field(description="Median over iterations of overlapped / whole (slowest rank each; below 1: overlap is faster here).")
    ratio_range: tuple[float, float] = Field(description="The least and greatest of those per-iteration ratios.")
    comm_whole_s: float = Field(description="The whole path's two all-to-alls (all exposed).")
    comm_exposed_s: float = Field(description="The overlapped path's time in its all-to-alls' own code: starting them, blocked waiting for them, unpacking the returns.")
    comm_in_flight_s: float | None = Field(description="Its all-to-alls' time from start to arrival, summed (CPU; None on CUDA: their stream is not timed).")

    @property
    def hidden_s(self) -> float:
        """Communication taken off the rank's path: the whole path's all-to-all time - the overlapped
        path's exposed time, in the same iterations (negative: overlap costs more than it hides)."""
        return self.comm_whole_s - self.comm_exposed_s


class TransportReport(BaseModel):
    """The result of `h3 bench-transport`, as printed by --json and written to the report file."""

    command: str = "bench-transport"
    config: TransportBenchConfig
    backend: str = Field(description="Process-group backend: gloo, nccl, or none at one rank.")
    cpu_allocator: str = Field("n/a", description="CPU allocator policy of the ranks (h3core.runtime.cpu_memory); n/a on CUDA.")
    tokens_per_rank: list[int]
    heads_per_rank: list[int]
    qkv_fused: bool = Field(default=True, description="q|k|v travel in one all-to-all ([S_loc, 3, H, Dh]).")
    identity_exact: bool = Field(description="head_to_seq(seq_to_head(x)) == x bit for bit on every rank.")
    blocks_exact: bool = Field(True, description="RoPE and v's GEMM written into the send blocks arrive bit for bit as seq_to_head of the finished q|k|v.")
    overlap_exact: bool = Field(True, description="Ulysses attention overlapped in head groups gives bit for bit the whole path's output (with attention).")
    v_gemm_input_width: int = Field(V_INPUT_WIDTH, description="Input width of the v GEMM timed in finish_one_rank and finish_into_blocks.")
    attention_kernels: list[dict[str, int]] = Field(default_factory=list, description="Per rank: the attention kernels its timed calls ran (kernel -> calls).")
    phases: dict[str, PhaseTiming]
    round_trip_s: float = Field(description="h3's round trip (finish_into_blocks - finish_one_rank + seq_to_head + head_to_seq): median over iterations of the signed sum of each phase's slowest rank.")
    wire_s: float = Field(description="The wire: plain all_to_all_single of the same bytes between buffers allocated once.")
    fresh_s: float = Field(description="The same into a freshly allocated receive buffer.")
    packed_round_trip_s: float = Field(description="seq_to_head of a stacked q|k|v (pack + all-to-all) + head_to_seq.")
    ratio: float | None = Field(description="round_trip_s / wire_s (None at one rank: nothing moves).")
    packed_ratio: float | None = Field(None, description="packed_round_trip_s / wire_s.")
    fresh_ratio: float | None = Field(None, description="fresh_s / wire_s: what fresh receive memory costs on this machine.")
    target_ratio: float = Field(description="The ratio h3 must stay within at this rank count.")
    overlap: OverlapTiming | None = Field(None, description="Ulysses attention whole vs overlapped in head groups (with attention only).")
    timing: str = Field(
        default="barrier before each timed region; device-synchronised; a phase's time in an iteration is its "
        "slowest rank's; per-iteration sums of phases; median over timed iterations",
        description="How the figures were taken.",
    )
    versions: Versions


# --- the rank side --------------------------------------------------------------------------------


@dataclass
class _Inputs:
    """One rank's inputs: its shares of q|k|v as the model has them before RoPE, and the splits."""

    tokens: list[Span]
    heads: list[Span]
    projected: ProjectedQKV  # q, k (normalised): [S_loc, H, Dh]; v: LinearHeads; angles [S_loc, Dh/2]
    qkv: torch.Tensor  # [S_loc, 3, H, Dh], the finished q|k|v
    stand_in_out: torch.Tensor  # [S, H_loc, Dh], what attention would return when it is not timed
    scratch: Scratch  # the collectives' CPU buffer, kept across calls as a rank's runtime keeps it
    choices: SdpaChoices  # the attention kernel's cached SDPA decisions, as the model's kernel keeps them
    groups: list[list[Span]]  # the overlapped path's head groups


def _inputs(ctx: RankContext, cfg: TransportBenchConfig) -> _Inputs:
    """Seeded random inputs (rank r: seed + r) in H3's head layout, sharded as h3 shards them."""
    dtype = compute_dtype(ctx.device.type, cfg.dtype)
    tokens, heads = token_spans(cfg.tokens, ctx.world_size), head_spans(cfg.heads, ctx.world_size)
    local_tokens, local_heads = len(tokens[ctx.rank]), len(heads[ctx.rank])
    generator = torch.Generator(device=ctx.device).manual_seed(cfg.seed + ctx.rank)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=ctx.device, dtype=dtype)

    angles = torch.rand(local_tokens, rotary_half(cfg.head_dim), generator=generator, device=ctx.device) * 6.3
    q, k, h = randn(local_tokens, cfg.heads, cfg.head_dim), randn(local_tokens, cfg.heads, cfg.head_dim), randn(local_tokens, V_INPUT_WIDTH)
    projected = ProjectedQKV(q, k, LinearHeads(_v_linear(ctx, cfg), h, 0, cfg.heads, cfg.head_dim), angles.cos(), angles.sin())
    qkv = torch.stack(projected.split(), dim=1)
    return _Inputs(tokens, heads, projected, qkv, randn(cfg.tokens, local_heads, cfg.head_dim), Scratch(), SdpaChoices(),
                   head_groups(heads, cfg.overlap_groups))


def _v_linear(ctx: RankContext, cfg: TransportBenchConfig) -> NVFP4Linear:
    """v's NVFP4 linear, `V_INPUT_WIDTH -> heads * head_dim` with a bias, the same on every rank (replicated)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    weight = torch.randn(cfg.heads * cfg.head_dim, V_INPUT_WIDTH, generator=generator)
    return NVFP4Linear.from_float(weight, torch.randn(weight.shape[0], generator=generator)).to(ctx.device)


def _exactness(ctx: RankContext, x: _Inputs) -> tuple[bool, bool]:
    """(seq->head->seq gives x back, RoPE written into the send blocks arrives as seq->head of the finished q|k|v)."""
    by_head = seq_to_head(x.qkv, x.tokens, x.heads, ctx.group)
    identity = bool(torch.equal(head_to_seq(by_head, x.tokens, x.heads, ctx.group), x.qkv))
    through_blocks = exchange_blocks(_write_blocks(x.projected, x.heads, x.scratch), x.tokens, x.heads, ctx.group)
    return identity, bool(torch.equal(through_blocks, by_head))


def _overlap_exactness(ctx: RankContext, cfg: TransportBenchConfig, x: _Inputs) -> bool:
    """Ulysses attention overlapped in head groups gives bit for bit the whole path's output."""
    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, cfg.attention, None, x.choices)

    via = Exchange(ctx.group, x.heads, None, x.scratch)
    return bool(torch.equal(attend_in_groups(x.projected, x.tokens, kernel, via, x.groups), attend_whole(x.projected, x.tokens, kernel, via)))


def _wire(ctx: RankContext, cfg: TransportBenchConfig, x: _Inputs) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """The wire for q|k|v and for the attention output: plain all-to-alls of the same bytes and splits."""
    s_loc, h_loc, dh = len(x.tokens[ctx.rank]), len(x.heads[ctx.rank]), cfg.head_dim
    return {
        "qkv": _all_to_all_of(ctx, x.qkv, [s_loc * 3 * len(h) * dh for h in x.heads], [len(t) * 3 * h_loc * dh for t in x.tokens]),
        "out": _all_to_all_of(ctx, x.stand_in_out, [len(t) * h_loc * dh for t in x.tokens], [s_loc * len(h) * dh for h in x.heads]),
    }


def _iteration(ctx: RankContext, cfg: TransportBenchConfig, x: _Inputs, wire: dict, stats: CommStats, timed: Callable, step: int,  # type: ignore[type-arg]
               kernels: Counter[str]) -> None:
    """One timed iteration of every phase, in the order of the module docstring, except that the two
    finishes swap places every other iteration: whichever runs second pays for writing back what the
    first left dirty in the cache (~15 ms at 4 ranks on the 2-core VM, either way round), so a fixed
    order would charge that to one of them."""
    if step % 2:
        blocks = timed("finish_into_blocks", lambda: _write_blocks(x.projected, x.heads, x.scratch))
        timed("finish_one_rank", x.projected.split)
    else:
        timed("finish_one_rank", x.projected.split)
        blocks = timed("finish_into_blocks", lambda: _write_blocks(x.projected, x.heads, x.scratch))
    by_head = timed("seq_to_head", lambda: exchange_blocks(blocks, x.tokens, x.heads, ctx.group, stats))
    out = timed("attention", lambda: _attend(by_head, cfg.attention, kernels, x.choices)) if cfg.time_attention else x.stand_in_out
    by_head = None  # freed before head->seq, as in the model
    timed("head_to_seq", lambda: head_to_seq(out, x.tokens, x.heads, ctx.group, stats, x.scratch))
    timed("seq_to_head_packed", lambda: seq_to_head(x.qkv, x.tokens, x.heads, ctx.group, None, x.scratch))
    for name, (preallocated, fresh) in wire.items():
        timed(f"wire_{name}", preallocated)
        timed(f"fresh_{name}", fresh)
    if cfg.time_attention:
        _overlap_iteration(ctx, cfg, x, timed, step, kernels)


def _overlap_iteration(ctx: RankContext, cfg: TransportBenchConfig, x: _Inputs, timed: Callable[..., Any], step: int, kernels: Counter[str]) -> None:
    """Ulysses attention whole and overlapped, in alternating order (module docstring, 9), each with
    its all-to-alls timed by a `CommClock` (and, overlapped, their time in flight on the CPU)."""
    clock, flights = CommClock(ctx.device), FlightLog()
    whole_stats, grouped_stats = CommStats(), CommStats()
    whole_stats.timer = grouped_stats.timer = clock.region
    grouped_stats.flights = flights

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, cfg.attention, kernels, x.choices)

    def whole() -> None:
        attend_whole(x.projected, x.tokens, kernel, Exchange(ctx.group, x.heads, whole_stats, x.scratch))
        timed("comm_whole", lambda: None, clock.take())

    def grouped() -> None:
        attend_in_groups(x.projected, x.tokens, kernel, Exchange(ctx.group, x.heads, grouped_stats, x.scratch), x.groups)
        timed("comm_exposed", lambda: None, clock.take())
        if ctx.device.type == "cpu":
            timed("comm_in_flight", lambda: None, sum(flights.take().values()))

    for phase, run in (("attend_whole", whole), ("attend_overlapped", grouped))[:: -1 if step % 2 else 1]:
        timed(phase, run)


class CommClock:
    """A `CommStats` timer that sums the seconds of the regions it times until `take()`: `perf_counter`
    on the CPU; on CUDA events on the current stream, read at `take()` (after the timed phase has
    synchronised), so timing does not stall the stream the way a synchronising stopwatch would."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pairs.append((start, end))
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds += time.perf_counter() - started

    def take(self) -> float:
        synchronize(torch.device("cuda") if self.cuda else torch.device("cpu"))
        seconds = self._seconds + sum(start.elapsed_time(end) / 1000.0 for start, end in self._pairs)
        self._seconds, self._pairs = 0.0, []
        return seconds


def _bench_rank(ctx: RankContext, cfg: TransportBenchConfig) -> dict[str, Any]:
    """Runs on every rank: builds the shards, checks exactness, times every phase."""
    x = _inputs(ctx, cfg)
    identity, blocks_exact = _exactness(ctx, x)
    wire = _wire(ctx, cfg, x)
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    stats, total = CommStats(), cfg.warmup + cfg.iters
    kernels: Counter[str] = Counter()  # the attention kernels this rank ran
    for step in range(total):
        maybe_inject_fault("iter", ctx.rank, step)
        keep = step >= cfg.warmup
        _iteration(ctx, cfg, x, wire, stats, lambda phase, work, seconds=None: _timed(ctx, samples[phase], keep, work, seconds), step, kernels)
        ctx.report(("iter", step + 1, total))
    if not cfg.time_attention:
        samples["attention"] = []
    overlap_exact = _overlap_exactness(ctx, cfg, x) if cfg.time_attention else True
    return {
        "identity": identity, "blocks_exact": blocks_exact, "overlap_exact": overlap_exact, "attention_kernels": dict(sorted(kernels.items())),
        "allocator": cpu_memory.policy() if ctx.device.type == "cpu" else "n/a", "samples": samples,
        "bytes": _bytes_per_call(stats, max(1, total)),
    }


def _bytes_per_call(stats: CommStats, calls: int) -> dict[str, int]:
    """Bytes each phase sends per call: h3's all-to-alls counted them; the wire moves the same bytes."""
    per_call = {kind: counts.bytes_sent // calls for kind, counts in stats.kinds.items()}
    qkv_bytes, out_bytes = per_call.get("seq_to_head", 0), per_call.get("head_to_seq", 0)
    return {
        "seq_to_head": qkv_bytes, "seq_to_head_packed": qkv_bytes, "wire_qkv": qkv_bytes, "fresh_qkv": qkv_bytes,
        "head_to_seq": out_bytes, "wire_out": out_bytes, "fresh_out": out_bytes,
    }


def rotary_half(head_dim: int) -> int:
    """Angles per row of H3's partial RoPE at this head width: 96 of 128 channels rotate (48 pairs),
    a multiple of 3 (one per (t, h, w) frequency)."""
    return max(3, 3 * head_dim // 8 // 3 * 3)


def _write_blocks(projected: ProjectedQKV, heads: list[Span], scratch: Scratch) -> SendBlocks:
    """Ulysses attention's producer step: RoPE of q, k and v's GEMM, into the send blocks."""
    local_tokens, _, head_dim = projected.q.shape
    blocks = send_blocks(local_tokens, (3,), head_dim, heads, projected.q, scratch)
    for head_range, view in blocks.pieces:
        projected.write(head_range, view)
    return blocks


def _attend(by_head: torch.Tensor, backend: str, kernels: "Counter[str]", choices: SdpaChoices) -> torch.Tensor:
    # by_head: [S, 3, H_loc, Dh] -> q, k, v: [S, H_loc, Dh] each -> out: [S, H_loc, Dh]
    return attend(by_head[:, 0], by_head[:, 1], by_head[:, 2], backend, kernels, choices)


def _all_to_all_of(ctx: RankContext, x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Two plain all_to_all_single of x's bytes with h3's split sizes (no-ops at one rank): into a
    receive buffer allocated once here (the wire), and into a fresh one per call."""
    flat = x.contiguous().view(-1)
    even = len(set(send_sizes)) == 1 and len(set(recv_sizes)) == 1
    ready = flat.new_empty(sum(recv_sizes))

    def run(recv: torch.Tensor) -> torch.Tensor:
        if ctx.group is not None:
            dist.all_to_all_single(recv, flat, None if even else recv_sizes, None if even else send_sizes, group=ctx.group)
        return recv

    return (lambda: run(ready)), (lambda: run(flat.new_empty(sum(recv_sizes))))


def _timed(ctx: RankContext, samples: list[float], keep: bool, work: Callable[[], Any], seconds: float | None = None) -> Any:
    """Barrier, then time `work` to device completion; the seconds go to `samples` when `keep`.
    `seconds` given: a figure measured inside another phase, kept as it is (nothing run or timed)."""
    if seconds is not None:
        if keep:
            samples.append(seconds)
        return None
    if ctx.group is not None:
        dist.barrier(group=ctx.group)
    synchronize(ctx.device)
    with Stopwatch(ctx.device) as watch:
        result = work()
    if keep:
        samples.append(watch.seconds)
    return result


# --- the parent side --------------------------------------------------------------------------------


def run_transport_benchmark(cfg: TransportBenchConfig, on_progress: Callable[[Any], None] | None = None) -> TransportReport | None:
    """`h3 bench-transport`: start `cfg.world_size` ranks, benchmark, summarise, and write the report
    to `cfg.report_file` (checked before any rank starts; written only when the run succeeded).

    Under torchrun every rank calls this; rank 0 gets the report, the other ranks None.
    """
    with Outputs(enabled=settings.is_rank_zero()) as outputs:
        target = outputs.file(cfg.report_file, flag="--output") if cfg.report_file is not None and outputs.enabled else None
        with World(cfg.world_size, cfg.device, on_progress=on_progress) as world:
            world.agree(cfg.model_dump_json(exclude={"report_file"}), "benchmark (COUNT, --tokens, --heads, --head-dim, ...)")
            per_rank = world.run(_bench_rank, cfg)
            backend, is_main = world.backend, world.is_main
        if not is_main:
            return None
        report = _summarise(cfg, backend, per_rank)
        if target is not None:
            target.write(report_json(report))
            outputs.publish()
    return report


def _summarise(cfg: TransportBenchConfig, backend: str, per_rank: list[dict[str, Any]]) -> TransportReport:
    round_trip, wire = combined(per_rank, ROUND_TRIP), combined(per_rank, WIRE)
    packed, fresh = combined(per_rank, PACKED_ROUND_TRIP), combined(per_rank, FRESH)
    moves = cfg.world_size > 1 and wire > 0

    def over_wire(seconds: float) -> float | None:
        return seconds / wire if moves else None

    return TransportReport(
        config=cfg, backend=backend, cpu_allocator=per_rank[0].get("allocator", "n/a"),
        tokens_per_rank=[len(s) for s in token_spans(cfg.tokens, cfg.world_size)],
        heads_per_rank=[len(s) for s in head_spans(cfg.heads, cfg.world_size)],
        identity_exact=all(r["identity"] for r in per_rank), blocks_exact=all(r["blocks_exact"] for r in per_rank),
        overlap_exact=all(r["overlap_exact"] for r in per_rank), overlap=_overlap_timing(cfg, per_rank),
        attention_kernels=[r.get("attention_kernels", {}) for r in per_rank], phases=_phases(cfg, per_rank),
        round_trip_s=round_trip, wire_s=wire, fresh_s=fresh, packed_round_trip_s=packed,
        ratio=over_wire(round_trip), packed_ratio=over_wire(packed), fresh_ratio=over_wire(fresh),
        target_ratio=target_ratio(cfg.world_size), versions=Versions.collect(),
    )


def _overlap_timing(cfg: TransportBenchConfig, per_rank: list[dict[str, Any]]) -> OverlapTiming | None:
    """Whole vs overlapped Ulysses attention (None without attention: nothing to hide the all-to-alls behind)."""
    if not cfg.time_attention:
        return None
    whole, grouped = combined(per_rank, {"attend_whole": 1}), combined(per_rank, {"attend_overlapped": 1})
    ratios = [g / w for g, w in zip(slowest(per_rank, "attend_overlapped"), slowest(per_rank, "attend_whole")) if w > 0]
    in_flight = combined(per_rank, {"comm_in_flight": 1}) if all(r["samples"]["comm_in_flight"] for r in per_rank) else None
    return OverlapTiming(
        groups=len(head_groups(head_spans(cfg.heads, cfg.world_size), cfg.overlap_groups)), whole_s=whole, overlapped_s=grouped,
        ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)), comm_whole_s=combined(per_rank, {"comm_whole": 1}),
        comm_exposed_s=combined(per_rank, {"comm_exposed": 1}), comm_in_flight_s=in_flight,
    )


def _phases(cfg: TransportBenchConfig, per_rank: list[dict[str, Any]]) -> dict[str, PhaseTiming]:
    """Per phase: every rank's median, the figure (median of the slowest rank per iteration), the bytes
    each rank sent and the bandwidth."""
    phases: dict[str, PhaseTiming] = {}
    for phase in PHASES:
        if not all(r["samples"][phase] for r in per_rank):  # not timed in this run (attention, overlap, CUDA's flights)
            continue
        medians = [statistics.median(r["samples"][phase]) for r in per_rank]
        sent = [int(r["bytes"].get(phase, 0)) for r in per_rank]
        figure = combined(per_rank, {phase: 1})
        gbps = max(sent) / figure / 1e9 if max(sent) and figure > 0 else None
        phases[phase] = PhaseTiming(median_s_per_rank=medians, median_s=figure, bytes_sent_per_rank=sent, gb_per_s=gbps)
    return phases


def slowest(per_rank: list[dict[str, Any]], phase: str) -> list[float]:
    """A phase's time in each timed iteration: its slowest rank's (the collective after it waits for that rank)."""
    return [max(times) for times in zip(*(r["samples"][phase] for r in per_rank))]


def combined(per_rank: list[dict[str, Any]], terms: dict[str, int]) -> float:
    """A signed sum of phases per iteration, each phase taking its slowest rank's time in that
    iteration (`slowest`); the median over iterations."""
    per_iteration = zip(*(slowest(per_rank, phase) for phase in terms))
    return statistics.median(sum(sign * t for sign, t in zip(terms.values(), row)) for row in per_iteration)


def report_file(chosen: Path | None, world_size: int, attention: str) -> Path | None:
    """Where the JSON report goes: a path ending in .json is the file itself (the seed's variable);
    anything else is a folder that receives `bench-transport-{N}x-{ATTN}.json`."""
    if chosen is None:
        return None
    if chosen.suffix.lower() == ".json":
        return chosen
    return chosen / f"bench-transport-{world_size}x-{attention}.json"


def transport_need(tokens: int, heads: int, head_dim: int, world_size: int, device: str, dtype: torch.dtype,
                   attention: str | None) -> MemoryNeed:
    """`h3 bench-transport`'s need per rank: q|k|v rows, their head-sharded copy, the output and the
    baseline's buffers (and attention's scores where its kernel materialises them)."""
    s_loc, h_loc = -(-tokens // world_size), -(-heads // world_size)
    rows = 2 * s_loc * 3 * heads * head_dim + s_loc * V_INPUT_WIDTH  # q|k|v, the send side of seq->head, v's input
    by_head = 2 * tokens * 3 * h_loc * head_dim  # received q|k|v and the baseline's receive buffer
    outputs = 2 * tokens * h_loc * head_dim  # the attention output (or its stand-in) and head->seq
    scores = scores_bytes(attention, device, dtype, h_loc, tokens, head_dim) if attention else 0
    on_device = {"activations": (rows + by_head + outputs) * dtype.itemsize, "attention scores": scores}
    on_host = {"process": PROCESS_BYTES} if world_size > 1 else {}
    return MemoryNeed(ranks=world_size, device=device, on_device=on_device, on_host=on_host, spawned=world_size > 1)
