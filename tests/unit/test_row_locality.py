"""The property both distributed modes rest on, on the CPU without processes: the model run on rows
`[a, b)` of a packed sequence gives rows `[a, b)` of the model run on every row.

Every part of a block but attention is row-local (norms, modulation by each row's table row, residual gates,
linears, the MLP, the final layer). Attention is not: a row attends over every token's k and v. So
the rows-only run gets attention the way Ulysses gives it: its own rows' q (finished here: RoPE at
their positions) against k and v of *every* row, taken from the all-rows run of the same block
(`_AllRowsKeys`, the kernel the model's processor calls). What this proves: the row-local parts on a slice (segments clipped and rebased with
their AdaLN rows, RoPE rows selected, text rows picked by kind) equal the slice of the whole, block after block and
through the final layer; attention's own exchange is proven by the transport and Ulysses tests
(tests/dist). Attention itself is computed the same way, row by row, in both runs, so every
difference comes from the row-local parts: none when the slice is all rows, and for a few-row slice
only the rounding of a GEMM on fewer rows (another CPU kernel; measured up to 6e-7 here), held to the
bound a Ulysses run's latents are held to (`tolerance`), which a real row-locality bug (a segment's
modulation applied in global, not local, coordinates) exceeds by orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch

from h3core.generate.parity import tolerance
from h3core.model.checkpoint import Checkpoint
from h3core.model.config import preset
from h3core.model.attention import AttentionKernel
from h3core.model.dit import Clocks, PackedSequence, rope_table
from h3core.model.positions import position_ids
from h3core.model.sequence import SegmentKind
from h3core.model.synthetic import synthetic_checkpoint
from h3core.parallel import partition
from h3core.parallel.modes import Mode
from h3core.reports.schema import error_between
from h3core.span import Span

CFG = preset("tiny")
CLOCKS = Clocks.of({"video": 0.7, "audio": 0.4})


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q [S_q, H, Dh] over k, v [S, H, Dh], one query row at a time (so that the all-rows
    run and a slice compute each row's attention with the very same arithmetic)."""
    scores = torch.einsum("qhd,khd->qhk", q, k) / q.shape[-1] ** 0.5  # [S_q, H, S]
    return torch.stack([torch.einsum("hk,khd->hd", row.softmax(-1), v) for row in scores])


class _Recorder(AttentionKernel):
    """The all-rows run's attention kernel: records each call's finished k and v."""

    def __init__(self, keys: list):
        super().__init__()
        self.keys = keys

    def forward(self, q, k, v):  # type: ignore[no-untyped-def]
        self.keys.append((k, v))
        return _attend(q, k, v)


class _AllRowsKeys(AttentionKernel):
    """The rows-only run's attention kernel: its rows' q against the recorded k and v of every row."""

    def __init__(self, keys: list):
        super().__init__()
        self.keys = keys

    def forward(self, q, k_rows, v_rows):  # type: ignore[no-untyped-def]
        # q: [S_loc, H, Dh], RoPE at this slice's own positions (the model's processor finished it)
        k, v = self.keys.pop(0)  # [S, H, Dh] each
        return _attend(q, k, v)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, _ = synthetic_checkpoint(CFG, seed=5, directory=tmp_path_factory.mktemp("ckpt"))
    return Checkpoint.open(path, CFG).load()


@pytest.fixture(scope="module")
def whole():
    """Every row of a 13-token prompt's sequence at the preset's size: segments, features, RoPE."""
    segments = CFG.segments(CFG.width, CFG.height, CFG.frames, 13)
    g = torch.Generator().manual_seed(11)
    widths = {SegmentKind.TEXT: CFG.hidden, SegmentKind.VIDEO: CFG.video_patch_dim, SegmentKind.AUDIO: CFG.audio_channels}
    features = {s.kind: torch.randn(len(s), widths[s.kind], generator=g) for s in segments}  # text: refined rows
    rope = rope_table(CFG, position_ids(segments, CFG.video_shape(CFG.width, CFG.height, CFG.frames)))
    return PackedSequence(segments=segments, features=features, rope=rope)


def _rows_of(seq: PackedSequence, rows: Span) -> PackedSequence:
    """What a rank holds of `seq`: its rows of each kind, segments clipped and rebased, RoPE rows selected."""
    held = partition.kind_rows(seq.segments, rows)
    features = {kind: seq.features[kind][span.start : span.stop] for kind, span in held.items()}
    return PackedSequence(segments=partition.clip_segments(seq.segments, rows), features=features, rope=seq.rope.select(rows))


def _velocity_rows(model, whole: PackedSequence, rows: Span) -> dict[SegmentKind, tuple[torch.Tensor, torch.Tensor]]:
    """(rows-only result, the same rows of the all-rows result) per latent kind."""
    keys: list = []
    kernels = [block.attn.processor.kernel for block in model.blocks]
    try:
        for block in model.blocks:
            block.attn.processor.kernel = _Recorder(keys)
        with torch.inference_mode():
            full = model(whole, CLOCKS)
        for block in model.blocks:
            block.attn.processor.kernel = _AllRowsKeys(keys)
        with torch.inference_mode():
            local = model(_rows_of(whole, rows), CLOCKS)
    finally:
        for block, kernel in zip(model.blocks, kernels):
            block.attn.processor.kernel = kernel
    held = partition.kind_rows(whole.segments, rows)
    return {kind: (local[kind], full[kind][held[kind].start : held[kind].stop]) for kind in local}


def _relative_error(pairs) -> float:  # type: ignore[no-untyped-def]
    worst = 0.0
    for local, expected in pairs.values():
        diff, scale = error_between(local, expected)
        worst = max(worst, diff / scale if scale else diff)
    return worst


@pytest.mark.parametrize("rows", [(0, 40), (5, 20), (10, 100), (80, 95), (200, 311)], ids=lambda r: f"rows{r[0]}-{r[1]}")
def test_the_model_on_some_rows_is_those_rows_of_the_model_on_all(model, whole, rows):
    # tiny at 13 text tokens: text [0, 13), audio [13, 87), video [87, 311): the slices start and
    # end inside segments, hold one kind, two or all three, and miss text or audio
    span = Span(*rows)
    pairs = _velocity_rows(model, whole, span)
    assert set(pairs) == {k for k in (SegmentKind.VIDEO, SegmentKind.AUDIO) if k in partition.kind_rows(whole.segments, span)}
    assert _relative_error(pairs) <= tolerance(Mode.ULYSSES, torch.float32)


def test_all_rows_through_the_slice_path_are_bitwise_the_whole(model, whole):
    """The harness itself (recorded k/v, the slice's inputs) adds nothing: all rows give the same bits."""
    pairs = _velocity_rows(model, whole, Span(0, whole.rope.num_tokens))
    assert all(torch.equal(local, expected) for local, expected in pairs.values())


def test_a_modulation_in_global_coordinates_exceeds_the_bound_by_orders_of_magnitude(model, whole, monkeypatch):
    """The bug row locality rules out: segments of a slice used without rebasing to its rows (each
    row's AdaLN table row read 5 rows off)."""
    real = Clocks.table_rows

    def unrebased(clocks: Clocks, segments: list, device: torch.device | str = "cpu") -> torch.Tensor:
        rows = real(clocks, segments, device)
        if rows.shape[0] == whole.rope.num_tokens:
            return rows
        return torch.cat([rows[:1].expand(5), rows[:-5]])  # every segment starts 5 rows late

    monkeypatch.setattr(Clocks, "table_rows", unrebased)
    error = _relative_error(_velocity_rows(model, whole, Span(5, 40)))
    assert error > 1000 * tolerance(Mode.ULYSSES, torch.float32), error
