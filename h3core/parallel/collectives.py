"""The collectives both distributed modes are built from: small typed functions over ragged spans.

Every function takes the spans of `h3core.parallel.partition` (`token_spans`, `head_spans`, or any
balanced row split); index `i` of a spans list belongs to rank `i` of `group`. `group=None` or a
1-rank group is the identity path: the input comes back untouched, no process group needed.

- `seq_to_head` / `head_to_seq`: the Ulysses all-to-all. One `all_to_all_single` each way with
  per-peer split sizes, so ragged tokens and ragged heads need no padding. Data is copied once
  per direction: `seq_to_head` packs each peer's heads into one contiguous block before sending
  (the receive buffer already *is* the `[S, *mid, H_loc, Dh]` result); `head_to_seq` sends its
  token rows as they lie and unpacks the received head blocks into `[S_loc, *mid, H, Dh]`.
  The pack can be skipped: `send_blocks` hands out the send buffer as views in the input's
  layout, a producer writes into them directly (Ulysses attention: the model's RoPE writes q
  and k there, v's GEMM writes v) and `exchange_blocks` sends them.
- `start_exchange_blocks` / `start_head_to_seq`: the same two all-to-alls for one head group
  (`partition.head_groups`), started with `async_op=True` and returned as `InFlight` (Ulysses
  overlap: attention on one group while the next travels; `h3core.parallel.overlap`).
- `gather_rows`: ragged all-gather. Gloo and NCCL gather equal sizes only, so every rank pads its
  rows to the longest share; the padding is cut off before the result is returned.
- `exchange_halves`: CFG parallel's one exchange per step between the two halves of a group (each
  rank gets the other half's values of its own rows; only overlapping row ranges move).
- `reduce_scatter_rows`: ragged reduce-scatter of row partials. An `all_to_all_single` hands every
  rank the partials of its own rows from all ranks (the same bytes a ring reduce-scatter moves),
  then they are summed locally in rank order: `((p_0 + p_1) + p_2) + ... + p_{W-1}`, in float32
  for 16-bit inputs and cast back once. The result is therefore the same on every run, on Gloo
  and NCCL alike, and independent of the transport's own reduction order.

Each call allocates exactly one new tensor, its result. Transient buffers (the packed send side
of `seq_to_head`, the receive side of `head_to_seq` and `reduce_scatter_rows`, the padded rows of
`gather_rows`) come from the caller's `Scratch` when it passes one (`scratch=`): on the CPU a
buffer kept and reused across calls, since fresh CPU memory of that size costs more in page faults
than the copy itself. A rank's runtime owns one (`ParallelRuntime.scratch`) for as long as its
pipeline lives; without one, and always on CUDA (whose caching allocator already recycles memory),
they are plain allocations. One thread per rank calls collectives (as process groups require anyway).

A `CommStats` may carry a timer (`CommStats.timer`): `h3core.generate.profile` times every collective
that counts into it by kind (unset: no timing).

`CommStats` counts, per collective kind, the calls and the bytes this rank sent to and received
from *other* ranks (its own share stays local and is not counted; gather padding is counted,
since it travels).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, Field, PrivateAttr

from h3core.span import Span

SEQ_TO_HEAD = "seq_to_head"
HEAD_TO_SEQ = "head_to_seq"
GATHER_ROWS = "gather_rows"
REDUCE_SCATTER_ROWS = "reduce_scatter_rows"
REPARTITION_ROWS = "repartition_rows"
CFG_EXCHANGE = "cfg_exchange"
BROADCAST = "broadcast"


class CollectiveCounts(BaseModel):
    """What one kind of collective moved on one rank (or summed over ranks)."""

    calls: int = Field(default=0, description="Times the collective ran.")
    bytes_sent: int = Field(default=0, description="Bytes sent to other ranks (the rank's own share excluded).")
    bytes_received: int = Field(default=0, description="Bytes received from other ranks.")


class CommStats(BaseModel):
    """Calls and bytes per collective kind ('seq_to_head', 'gather_rows', ...); mergeable. One rank's
    counters may carry a `timer` (`--profile`) that times every collective counted into them."""

    kinds: dict[str, CollectiveCounts] = Field(default_factory=dict, description="Counts by collective kind.")
    _timer: "RegionTimer | None" = PrivateAttr(default=None)
    _flights: "FlightLog | None" = PrivateAttr(default=None)

    @property
    def timer(self) -> "RegionTimer | None":
        return self._timer

    @timer.setter
    def timer(self, timer: "RegionTimer | None") -> None:
        self._timer = timer

    @property
    def flights(self) -> "FlightLog | None":
        """Where collectives started in flight (`InFlight`) log their time to arrival; None: not logged."""
        return self._flights

    @flights.setter
    def flights(self, log: "FlightLog | None") -> None:
        self._flights = log

    def record(self, kind: str, bytes_sent: int, bytes_received: int) -> None:
        counts = self.kinds.setdefault(kind, CollectiveCounts())
        counts.calls += 1
        counts.bytes_sent += bytes_sent
        counts.bytes_received += bytes_received

    def merged(self, other: "CommStats") -> "CommStats":
        """A new `CommStats` holding the sums of both (e.g. over steps, or over ranks)."""
        out = self.model_copy(deep=True)
        for kind, counts in other.kinds.items():
            mine = out.kinds.setdefault(kind, CollectiveCounts())
            mine.calls += counts.calls
            mine.bytes_sent += counts.bytes_sent
            mine.bytes_received += counts.bytes_received
        return out

    @classmethod
    def total(cls, stats: Iterable["CommStats"]) -> "CommStats":
        """The sum of several ranks' (or steps') stats."""
        out = cls()
        for one in stats:
            out = out.merged(one)
        return out

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.kinds.values())

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.kinds.values())


# --- timing hook (h3core.generate.profile) ------------------------------------------------------------------

RegionTimer = Callable[[str], ContextManager[None]]


F = TypeVar("F", bound=Callable[..., Any])


def _timed_as(kind: str) -> Callable[[F], F]:
    """Time the collective as a region named `kind` by the timer of the `CommStats` it is given
    (`CommStats.timer`, set by `--profile` on that rank's counters; unset: no timing)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            stats = kwargs.get("stats") or next((a for a in args if isinstance(a, CommStats)), None)
            timer = stats.timer if stats is not None else None
            if timer is None:
                return fn(*args, **kwargs)
            with timer(kind):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap


# --- group and span bookkeeping ----------------------------------------------------------------


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in `group` and the group's size; `(0, 1)` for `None`."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_spans(spans: Sequence[Span], size: int, what: str, allow_empty: bool = False) -> int:
    """Spans must cover `[0, n)` contiguously, one per rank (non-empty unless allowed); returns `n`."""
    if len(spans) != size:
        raise ValueError(f"{len(spans)} {what} spans for a group of {size} ranks")
    start = 0
    for span in spans:
        if span.start != start or (len(span) == 0 and not allow_empty):
            raise ValueError(f"{what} spans {[s.as_list() for s in spans]} are not contiguous, non-empty and in rank order")
        start = span.stop
    return start


@dataclass(frozen=True)
class UlyssesLayout:
    """The checked layout of one Ulysses all-to-all on this rank (`_ulysses_layout`)."""

    rank: int
    size: int
    num_tokens: int
    num_heads: int


def _ulysses_layout(tokens: Sequence[Span], heads: Sequence[Span], group: dist.ProcessGroup | None) -> UlyssesLayout:
    """What `seq_to_head`, `exchange_blocks` and `head_to_seq` check first: one token span and one
    head span per rank of `group`, each contiguous, non-empty and in rank order."""
    rank, size = group_rank_and_size(group)
    return UlyssesLayout(rank, size, _check_spans(tokens, size, "token"), _check_spans(heads, size, "head"))


def _record(stats: CommStats | None, kind: str, sent: Sequence[int], received: Sequence[int], rank: int, itemsize: int) -> None:
    """Count element splits (per peer) as bytes to and from other ranks."""
    if stats is not None:
        others_sent = sum(sent) - sent[rank]
        others_received = sum(received) - received[rank]
        stats.record(kind, others_sent * itemsize, others_received * itemsize)


def _all_to_all(recv: torch.Tensor, send: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group: dist.ProcessGroup | None,
                async_op: bool = False) -> Any:
    """`all_to_all_single` on flat buffers; equal splits take the library's even-split path. With
    `async_op` it returns the started work (`InFlight`), else None once the data has arrived."""
    even = len(set(send_sizes)) == 1 and len(set(recv_sizes)) == 1
    return dist.all_to_all_single(recv, send, None if even else recv_sizes, None if even else send_sizes, group=group, async_op=async_op)


class Scratch:
    """The transient buffer one rank's collectives reuse on the CPU (module docstring): grown on
    demand, valid until the next collective that takes it; owned by whoever passes it (a rank's runtime)."""

    def __init__(self) -> None:
        self._bytes: torch.Tensor | None = None

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A 1-D buffer of `numel` elements of `like`'s dtype (a plain allocation off the CPU)."""
        if like.device.type != "cpu":
            return like.new_empty(numel)
        nbytes = numel * like.element_size()
        if self._bytes is None or self._bytes.numel() < nbytes:
            self._bytes = None  # free the old one before allocating the larger one
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        return self._bytes[:nbytes].view(like.dtype)

    def release(self) -> None:
        """Free the buffer (it is allocated again by the next collective that needs it)."""
        self._bytes = None


def transient(numel: int, like: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """A transient 1-D buffer: from `scratch` when given, else a plain allocation."""
    return scratch.take(numel, like) if scratch is not None else like.new_empty(numel)


def _uniform_runs(spans: Sequence[Span]) -> list[tuple[int, int, int, int]]:
    """Consecutive, adjacent spans of equal width, as `(first_index, count, width, start)`.

    A balanced split has at most two runs (the `q + 1` ranks, then the `q` ranks), so a pack
    or unpack over all ranks takes at most two strided copies. The spans of one head group
    (`partition.head_groups`) are not adjacent: one run each.
    """
    runs: list[tuple[int, int, int, int]] = []
    for index, span in enumerate(spans):
        if runs and runs[-1][2] == len(span) and span.start == runs[-1][3] + runs[-1][1] * runs[-1][2]:
            first, count, width, start = runs[-1]
            runs[-1] = (first, count + 1, width, start)
        else:
            runs.append((index, 1, len(span), span.start))
    return runs


# --- Ulysses all-to-all --------------------------------------------------------------------------


@_timed_as(SEQ_TO_HEAD)
def seq_to_head(
    x: torch.Tensor,
    tokens: Sequence[Span],
    heads: Sequence[Span],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Sequence-sharded -> head-sharded. x: [S_loc, *mid, H, Dh] -> [S, *mid, H_loc, Dh].

    Dim 0 of `x` is this rank's token rows `tokens[rank]`, dim -2 every head; the result holds
    every token (in packed order) for this rank's heads `heads[rank]`. `mid` may be empty or e.g.
    `3` for a fused q|k|v, which then travels in one all-to-all. The one copy: x into `send_blocks`.
    """
    if group_rank_and_size(group)[1] == 1:
        return x
    layout = _ulysses_layout(tokens, heads, group)
    if x.shape[0] != len(tokens[layout.rank]) or x.shape[-2] != layout.num_heads:
        raise ValueError(f"seq_to_head: x {tuple(x.shape)} does not match {len(tokens[layout.rank])} local tokens x {layout.num_heads} heads")
    blocks = send_blocks(x.shape[0], tuple(x.shape[1:-2]), x.shape[-1], heads, x, scratch)
    for head_range, view in blocks.pieces:
        view.copy_(x[..., head_range, :].unflatten(-2, view.shape[-3:-1]))
    return exchange_blocks(blocks, tokens, heads, group, stats)


@dataclass(frozen=True)
class SendBlocks:
    """The send buffer of Ulysses' seq->head all-to-all, and views of it in the input's layout.

    `buffer` holds, for each peer j in rank order, one contiguous block `[S_loc, *mid, H_j, Dh]`:
    peer j's heads of this rank's tokens. A producer writes heads straight into it through `pieces`:
    `(head_range, view)`, `view` being `[S_loc, *mid, count, w, Dh]`, the heads `head_range` of an
    input `[S_loc, *mid, H, Dh]` grouped into `count` peers of `w` heads each (a balanced split has
    at most two such runs). The model's RoPE writes q and k this way (`ProjectedQKV.write`).
    """

    buffer: torch.Tensor  # flat
    pieces: list[tuple[slice, torch.Tensor]]
    local_tokens: int
    mid: tuple[int, ...]
    head_dim: int


def send_blocks(local_tokens: int, mid: tuple[int, ...], head_dim: int, heads: Sequence[Span], like: torch.Tensor,
                scratch: Scratch | None = None, into: torch.Tensor | None = None) -> SendBlocks:
    """An (uninitialised) send buffer for `seq_to_head` of `[local_tokens, *mid, H, Dh]` in `like`'s dtype.

    With `scratch` it is the scratch buffer on the CPU (valid until the next collective that takes it);
    `into`: a flat buffer to use instead (its first elements), e.g. one head group's part of a larger one.
    `heads` may be one head group's spans (`partition.head_groups`): then H counts the group's heads.
    """
    inner = math.prod(mid)
    numel = local_tokens * inner * sum(len(h) for h in heads) * head_dim
    buffer = into[:numel] if into is not None else transient(numel, like, scratch)
    # view of one run: [count, S_loc, *mid, w, Dh] -> [S_loc, *mid, count, w, Dh]
    order = (1, *range(2, 2 + len(mid)), 0, 2 + len(mid), 3 + len(mid))
    pieces = []
    for first, count, width, start in _uniform_runs(heads):
        begin = _offset(heads, first, local_tokens * inner * head_dim)
        run = buffer[begin : begin + count * local_tokens * inner * width * head_dim]
        view = run.view(count, local_tokens, *mid, width, head_dim).permute(order)
        pieces.append((slice(start, start + count * width), view))
    return SendBlocks(buffer, pieces, local_tokens, tuple(mid), head_dim)


@_timed_as(SEQ_TO_HEAD)
def exchange_blocks(
    blocks: SendBlocks,
    tokens: Sequence[Span],
    heads: Sequence[Span],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """The all-to-all of filled `SendBlocks`: -> [S, *mid, H_loc, Dh] (this rank's heads, every token)."""
    layout = _ulysses_layout(tokens, heads, group)
    rank, size, num_tokens = layout.rank, layout.size, layout.num_tokens
    if size == 1:  # one block holding every head: it is the result
        return blocks.buffer.view(num_tokens, *blocks.mid, len(heads[0]), blocks.head_dim)
    if blocks.local_tokens != len(tokens[rank]):
        raise ValueError(f"exchange_blocks: blocks hold {blocks.local_tokens} token rows, rank {rank} owns {len(tokens[rank])}")
    inner, head_dim, local_heads = math.prod(blocks.mid), blocks.head_dim, len(heads[rank])
    send_sizes = [blocks.local_tokens * inner * len(h) * head_dim for h in heads]
    recv_sizes = [len(t) * inner * local_heads * head_dim for t in tokens]
    recv = blocks.buffer.new_empty(sum(recv_sizes))
    _all_to_all(recv, blocks.buffer, recv_sizes, send_sizes, group)
    _record(stats, SEQ_TO_HEAD, send_sizes, recv_sizes, rank, recv.element_size())
    # Peer j's block is [S_j, inner, H_loc, Dh]; in rank order they already form [S, inner, H_loc, Dh].
    return recv.view(num_tokens, *blocks.mid, local_heads, head_dim)


def _offset(spans: Sequence[Span], index: int, per_item: int) -> int:
    """Elements before block `index` of a buffer whose block `j` holds `len(spans[j]) * per_item`."""
    return sum(len(span) for span in spans[:index]) * per_item


@_timed_as(HEAD_TO_SEQ)
def head_to_seq(
    x: torch.Tensor,
    tokens: Sequence[Span],
    heads: Sequence[Span],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Head-sharded -> sequence-sharded, the inverse of `seq_to_head`. x: [S, *mid, H_loc, Dh] -> [S_loc, *mid, H, Dh]."""
    if group_rank_and_size(group)[1] == 1:
        return x
    layout = _ulysses_layout(tokens, heads, group)
    rank, num_tokens, num_heads = layout.rank, layout.num_tokens, layout.num_heads
    mid, local_heads, head_dim = tuple(x.shape[1:-2]), x.shape[-2], x.shape[-1]
    if x.shape[0] != num_tokens or local_heads != len(heads[rank]):
        raise ValueError(f"head_to_seq: x {tuple(x.shape)} does not match {num_tokens} tokens x {len(heads[rank])} local heads")
    inner = math.prod(mid)
    local_tokens = len(tokens[rank])
    # Token rows of peer j are contiguous in x, so x itself (made contiguous) is the send buffer.
    send = x.contiguous().view(-1)
    send_sizes = [len(t) * inner * local_heads * head_dim for t in tokens]
    recv_sizes = [local_tokens * inner * len(h) * head_dim for h in heads]
    recv = transient(sum(recv_sizes), x, scratch)
    _all_to_all(recv, send, recv_sizes, send_sizes, group)
    _record(stats, HEAD_TO_SEQ, send_sizes, recv_sizes, rank, x.element_size())
    out = x.new_empty(local_tokens, inner, num_heads, head_dim)
    _unpack_heads(recv, heads, out)
    return out.view(local_tokens, *mid, num_heads, head_dim)


def _unpack_heads(recv: torch.Tensor, heads: Sequence[Span], out: torch.Tensor) -> None:
    """Peer j's received block [S_loc, inner, H_j, Dh] (in rank order in the flat `recv`) into heads
    `heads[j]` of out: [S_loc, inner, H, Dh]; one strided copy per run of adjacent equal spans."""
    local_tokens, inner, _, head_dim = out.shape
    for first, count, width, start in _uniform_runs(heads):
        begin = _offset(heads, first, local_tokens * inner * head_dim)
        src = recv[begin : begin + count * local_tokens * inner * width * head_dim].view(count, local_tokens, inner, width, head_dim)
        out[:, :, start : start + count * width].unflatten(2, (count, width)).copy_(src.permute(1, 2, 0, 3, 4))


# --- Ulysses all-to-all in head groups, in flight (overlap) -----------------------------------------


def _region(stats: CommStats | None, kind: str) -> ContextManager[Any]:
    """The stats' timer's region `kind` (`--profile`), or nothing."""
    timer = stats.timer if stats is not None else None
    return timer(kind) if timer is not None else contextlib.nullcontext()


class InFlight:
    """One all-to-all of a head group started with `async_op=True` (Gloo runs it on its own threads,
    NCCL on its own stream, while this rank computes): `wait()` blocks until it has arrived and gives
    its result (after `finish`, e.g. the return's unpack). With a `CommStats` timer set (`--profile`),
    starting it and `wait()` (blocked, then finishing) count in the collective's region: the exposed
    time; on the CPU the time from its start to its arrival goes to the stats' `FlightLog`."""

    def __init__(self, kind: str, work: Any, result: torch.Tensor, stats: CommStats | None,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None, keep: tuple[torch.Tensor, ...] = ()):
        self.kind, self.work, self.result, self.stats, self.finish = kind, work, result, stats, finish
        self.keep = keep  # what the transfer reads from: alive until it has arrived
        self._logged = None  # the future of the arrival's log entry (waited for with the work)
        log = stats.flights if stats is not None else None
        if log is not None and work is not None and result.device.type == "cpu":
            started = time.perf_counter()
            self._logged = work.get_future().then(lambda _: log.add(kind, time.perf_counter() - started))

    def wait(self) -> torch.Tensor:
        with _region(self.stats, self.kind):
            if self.work is not None:
                self.work.wait()
            if self._logged is not None:
                self._logged.wait()
            result = self.finish(self.result) if self.finish is not None else self.result
        self.keep = ()
        return result


class FlightLog:
    """Seconds each kind of collective spent in flight, from its start to its arrival (`InFlight`),
    summed until `take()`; set on a rank's `CommStats` by `--profile` (`CommStats.flights`)."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()  # Gloo reports arrivals from its own threads

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._seconds[kind] = self._seconds.get(kind, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """What was logged since the last `take()` (the arrivals that have happened), and start again."""
        with self._lock:
            taken, self._seconds = self._seconds, {}
        return taken


def _group_layout(tokens: Sequence[Span], heads: Sequence[Span], group: dist.ProcessGroup | None, what: str) -> tuple[int, int]:
    """(rank, size) of an all-to-all of one head group: a token span per rank covering the sequence,
    and one non-empty head span per rank (not adjacent: `partition.head_groups`)."""
    rank, size = group_rank_and_size(group)
    _check_spans(tokens, size, "token")
    if len(heads) != size or any(len(h) == 0 for h in heads):
        raise ValueError(f"{what}: head group {[h.as_list() for h in heads]} needs one non-empty span per rank of {size}")
    return rank, size


def start_exchange_blocks(
    blocks: SendBlocks,
    tokens: Sequence[Span],
    heads: Sequence[Span],
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> InFlight:
    """`exchange_blocks` of one head group's filled `SendBlocks` (`heads`: the group's span of every
    rank's heads), started and not waited for: its result is [S, *mid, H_g, Dh], H_g = len(heads[rank])."""
    with _region(stats, SEQ_TO_HEAD):
        rank, size = _group_layout(tokens, heads, group, "start_exchange_blocks")
        inner, head_dim, local_heads = math.prod(blocks.mid), blocks.head_dim, len(heads[rank])
        send_sizes = [blocks.local_tokens * inner * len(h) * head_dim for h in heads]
        recv_sizes = [len(t) * inner * local_heads * head_dim for t in tokens]
        recv = blocks.buffer.new_empty(sum(recv_sizes)) if size > 1 else blocks.buffer
        work = _all_to_all(recv, blocks.buffer, recv_sizes, send_sizes, group, async_op=True) if size > 1 else None
        _record(stats, SEQ_TO_HEAD, send_sizes, recv_sizes, rank, recv.element_size())
    by_head = recv.view(tokens[-1].stop, *blocks.mid, local_heads, head_dim)
    return InFlight(SEQ_TO_HEAD, work, by_head, stats, keep=(blocks.buffer,))


def start_head_to_seq(
    x: torch.Tensor,
    tokens: Sequence[Span],
    heads: Sequence[Span],
    out: torch.Tensor,
    recv: torch.Tensor,
    group: dist.ProcessGroup | None,
    stats: CommStats | None = None,
) -> InFlight:
    """`head_to_seq` of one head group, started and not waited for. x: [S, *mid, H_g, Dh], this rank's
    heads of the group (`heads`: the group's span of every rank's heads). `wait()` writes the heads
    of the group into out: [S_loc, *mid, H, Dh] (contiguous) and returns it; `recv`: a flat buffer
    of S_loc * inner * (the group's heads) * Dh elements, untouched until then."""
    with _region(stats, HEAD_TO_SEQ):
        rank, size = _group_layout(tokens, heads, group, "start_head_to_seq")
        inner, local_tokens, head_dim = math.prod(x.shape[1:-2]), len(tokens[rank]), x.shape[-1]
        if x.shape[0] != tokens[-1].stop or x.shape[-2] != len(heads[rank]):
            raise ValueError(f"start_head_to_seq: x {tuple(x.shape)} is not every token of {len(heads[rank])} heads")
        send = x.contiguous().view(-1)
        send_sizes = [len(t) * inner * len(heads[rank]) * head_dim for t in tokens]
        recv_sizes = [local_tokens * inner * len(h) * head_dim for h in heads]
        recv = recv[: sum(recv_sizes)]
        work = _all_to_all(recv, send, recv_sizes, send_sizes, group, async_op=True) if size > 1 else None
        if size == 1:
            recv.copy_(send)
        _record(stats, HEAD_TO_SEQ, send_sizes, recv_sizes, rank, x.element_size())

    def unpack(received: torch.Tensor) -> torch.Tensor:
        _unpack_heads(received, heads, out.view(local_tokens, inner, out.shape[-2], head_dim))
        return out

    return InFlight(HEAD_TO_SEQ, work, recv, stats, unpack, keep=(send,))


# --- ragged rows -----------------------------------------------------------------------------------


@_timed_as(GATHER_ROWS)
def gather_rows(
    x: torch.Tensor,
    rows: Sequence[Span],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Ragged all-gather along dim 0. x: [n_loc, *F] (rows `rows[rank]`) -> [n, *F] on every rank.

    A rank may own no rows (an empty span), e.g. when gathering one segment kind's rows.
    """
    rank, size = group_rank_and_size(group)
    if size == 1:
        return x
    num_rows = _check_spans(rows, size, "row", allow_empty=True)
    if x.shape[0] != len(rows[rank]):
        raise ValueError(f"gather_rows: x has {x.shape[0]} rows, rank {rank} owns {len(rows[rank])}")
    features = tuple(x.shape[1:])
    longest = max(len(s) for s in rows)
    if longest == 0:
        return x
    even = all(len(s) == longest for s in rows)
    # padded: [longest, *F]; rows past len(rows[rank]) are the temporary padding (zeros).
    padded = x.contiguous()
    if not even and x.shape[0] < longest:
        padded = torch.cat([padded, x.new_zeros(longest - x.shape[0], *features)])
    # gathered: [W * longest, *F] (the concatenated form Gloo and NCCL both accept). Evenly
    # split, it is the result; otherwise a transient from which the padding is cut.
    numel = size * longest * math.prod(features)
    gathered = (x.new_empty(numel) if even else transient(numel, x, scratch)).view(size * longest, *features)
    _all_gather(gathered, padded, group)
    row_bytes = math.prod(features) * x.element_size()
    if stats is not None:
        stats.record(GATHER_ROWS, (size - 1) * longest * row_bytes, (size - 1) * longest * row_bytes)
    if even:
        return gathered.view(num_rows, *features)
    by_rank = gathered.view(size, longest, *features)
    return torch.cat([by_rank[j, : len(s)] for j, s in enumerate(rows)])


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    # torch >= 2.13 names it all_gather_single; older releases (RunPod's 2.9) all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


@_timed_as(REDUCE_SCATTER_ROWS)
def reduce_scatter_rows(
    x: torch.Tensor,
    rows: Sequence[Span],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Ragged reduce-scatter along dim 0. x: [n, *F] partial on every rank -> [n_loc, *F]: the sum
    over ranks of rows `rows[rank]`, added in rank order (see the module docstring)."""
    rank, size = group_rank_and_size(group)
    if size == 1:
        return x
    num_rows = _check_spans(rows, size, "row")
    if x.shape[0] != num_rows:
        raise ValueError(f"reduce_scatter_rows: x has {x.shape[0]} rows, the spans cover {num_rows}")
    features = tuple(x.shape[1:])
    row_numel = math.prod(features)
    local_rows = len(rows[rank])
    # Peer j gets our partial of its rows rows[j] (contiguous in x: no copy); we get theirs of ours.
    send = x.contiguous().view(-1)
    send_sizes = [len(s) * row_numel for s in rows]
    recv_sizes = [local_rows * row_numel] * size
    recv = transient(size * local_rows * row_numel, x, scratch)
    _all_to_all(recv, send, recv_sizes, send_sizes, group)
    _record(stats, REDUCE_SCATTER_ROWS, send_sizes, recv_sizes, rank, x.element_size())
    return _sum_in_rank_order(recv.view(size, local_rows, *features))


def _sum_in_rank_order(partials: torch.Tensor) -> torch.Tensor:
    """partials: [W, n_loc, *F] -> ((p_0 + p_1) + p_2) + ...; 16-bit floats accumulate in float32."""
    low_precision = partials.dtype in (torch.float16, torch.bfloat16)
    total = partials[0].float() if low_precision else partials[0].clone()
    for partial in partials[1:]:
        total += partial
    return total.to(partials.dtype) if low_precision else total


# --- re-splitting rows, and broadcasting from one rank ------------------------------------------------


@_timed_as(REPARTITION_ROWS)
def repartition_rows(
    x: torch.Tensor,
    source: Sequence[Span],
    target: Sequence[Span],
    group: dist.ProcessGroup | None = None,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Move rows from one split to another. x: [n_loc, *F] holding rows `source[rank]` -> rows `target[rank]`.

    Each rank sends peer j the rows of `source[rank] ∩ target[j]` (one all-to-all; spans may be
    empty); identical splits cost nothing. Used when two packed sequences of one run (prompt and
    negative prompt) split the same latent rows differently.
    """
    rank, size = group_rank_and_size(group)
    if size == 1 or list(source) == list(target):
        return x
    num_rows = _check_spans(source, size, "source row", allow_empty=True)
    if _check_spans(target, size, "target row", allow_empty=True) != num_rows:
        raise ValueError("repartition_rows: source and target spans cover different row counts")
    if x.shape[0] != len(source[rank]):
        raise ValueError(f"repartition_rows: x has {x.shape[0]} rows, rank {rank} owns {len(source[rank])}")
    features = tuple(x.shape[1:])
    row_numel = math.prod(features)

    mine, wanted = source[rank], target[rank]
    # The targets tile every row, so the pieces for peers 0..W-1 are x's rows in order: x is the send buffer.
    send_rows = [mine.overlap(t) for t in target]
    recv_rows = [s.overlap(wanted) for s in source]
    out = x.new_empty(len(wanted), *features)
    send_sizes = [n * row_numel for n in send_rows]
    recv_sizes = [n * row_numel for n in recv_rows]
    dist.all_to_all_single(out.view(-1), x.contiguous().view(-1), recv_sizes, send_sizes, group=group)
    _record(stats, REPARTITION_ROWS, send_sizes, recv_sizes, rank, x.element_size())
    return out


HalfPart = tuple[torch.Tensor, Sequence[Span], Sequence[Span]]
"""One tensor of `exchange_halves`: (x, own, other): x [n_loc, *F] holds rows `own[local]` of a tensor
that this rank's half splits as `own` and the other half as `other` (both spans cover the same rows)."""


@_timed_as(CFG_EXCHANGE)
def exchange_halves(parts: Sequence[HalfPart], group: dist.ProcessGroup | None, stats: CommStats | None = None) -> list[torch.Tensor]:
    """CFG parallel's exchange: for each part, the OTHER half's values of this rank's rows own[local].

    `group` has 2N ranks, two halves of N: group rank `b * N + l` is local rank `l` of half `b`.
    Peer `j` of the other half sends the rows `other[j] ∩ own[l]` it holds; together they tile
    `own[l]`, in order. One all-to-all carries every part (per peer, each part's rows flattened, in
    part order; the parts share a dtype); nothing moves within a half. Returns [n_loc, *F] per part.
    """
    rank, size = group_rank_and_size(group)
    if size < 2 or size % 2:
        raise ValueError(f"exchange_halves needs a group of two equal halves, got {size} rank(s)")
    n = size // 2
    half, local = divmod(rank, n)
    peers = range((1 - half) * n, (2 - half) * n)  # the other half's group ranks, local order
    for x, own, other in parts:
        covered = _check_spans(own, n, "own row", allow_empty=True)
        if _check_spans(other, n, "other row", allow_empty=True) != covered or x.shape[0] != len(own[local]):
            raise ValueError(f"exchange_halves: x {tuple(x.shape)} is not rows {own[local]} of a split both halves cover")
    send = torch.cat([piece.reshape(-1) for j in range(n) for piece in _rows_for(parts, local, j)])
    send_sizes, recv_sizes = [0] * size, [0] * size
    for j, peer in enumerate(peers):
        send_sizes[peer] = sum(own[local].overlap(other[j]) * _row_numel(x) for x, own, other in parts)
        recv_sizes[peer] = sum(other[j].overlap(own[local]) * _row_numel(x) for x, own, other in parts)
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    _record(stats, CFG_EXCHANGE, send_sizes, recv_sizes, rank, send.element_size())
    return _unpack_halves(recv, parts, local, n)


def _row_numel(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:])


def _rows_for(parts: Sequence[HalfPart], local: int, j: int) -> list[torch.Tensor]:
    """The rows of each part this rank sends to the other half's local rank `j`: own[local] ∩ other[j]."""
    pieces = []
    for x, own, other in parts:
        mine, theirs = own[local], other[j]
        start, stop = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
        pieces.append(x[start - mine.start : max(start, stop) - mine.start])
    return pieces


def _unpack_halves(recv: torch.Tensor, parts: Sequence[HalfPart], local: int, n: int) -> list[torch.Tensor]:
    """Split the received buffer (peer-major, then part) into each part's rows own[local], in order."""
    pieces: list[list[torch.Tensor]] = [[] for _ in parts]
    offset = 0
    for j in range(n):
        for index, (x, own, other) in enumerate(parts):
            rows = other[j].overlap(own[local])
            numel = rows * _row_numel(x)
            pieces[index].append(recv[offset : offset + numel].view(rows, *x.shape[1:]))
            offset += numel
    return [p[0] if len(p) == 1 else torch.cat(p) for p in pieces]


@_timed_as(BROADCAST)
def broadcast_tensors(
    tensors: list[torch.Tensor] | None,
    src: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    stats: CommStats | None = None,
) -> list[torch.Tensor]:
    """Rank `src` (of `group`) sends a list of tensors to every rank: shapes and dtypes first, then data.

    Other ranks pass None. Tensors travel on `device` (the rank's CUDA device under NCCL).
    """
    rank, size = group_rank_and_size(group)
    if size == 1:
        return list(tensors or [])
    header = [[(tuple(t.shape), t.dtype) for t in tensors] if rank == src else None]
    dist.broadcast_object_list(header, src=dist.get_global_rank(group, src), group=group, device=device)
    out = []
    sent = 0
    for i, (shape, dtype) in enumerate(header[0]):
        t = tensors[i].to(device).contiguous() if rank == src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        out.append(t)
        sent += t.numel() * t.element_size()
    if stats is not None:
        stats.record(BROADCAST, sent * (size - 1) if rank == src else 0, 0 if rank == src else sent)
    return out
