"""One packed sequence given in diffusers' `MiniMaxH3Transformer3DModel.forward` convention, as h3's
`PackedSequence` + `Clocks`, and the adapter that runs an `H3Model` on it (`diffusers_forward`: the
entry point outside checks call, `diffusers_forward(load_transformer(path), hidden_states=..., ...)`).

diffusers describes the sequence per row: which rows are text, video, audio (`*_indices`, any order),
each row's modality tag (`token_tags`) and timestep (`timestep_indices` into the distinct `timestep`
values), and `(t, h, w)` positions. h3 describes it as segments of rows sharing kind, tag and
clock: the rows are run-length encoded here, each kind's inputs put in packed order, and the
outputs handed back in the caller's index order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from h3core.model.inputs import Clocks, PackedSequence, rope_table
from h3core.model.sequence import Segment, SegmentKind

if TYPE_CHECKING:
    from h3core.model.dit import H3Model

_KINDS = (SegmentKind.TEXT, SegmentKind.VIDEO, SegmentKind.AUDIO)


def diffusers_forward(
    model: "H3Model",
    hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    timestep_indices: torch.Tensor,
    token_tags: torch.Tensor,
    position_ids: torch.Tensor,
    video_indices: torch.Tensor,
    audio_indices: torch.Tensor,
    text_indices: torch.Tensor,
    return_dict: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`model` on one packed sequence in diffusers' `MiniMaxH3Transformer3DModel.forward` convention (a
    leading batch axis of 1 accepted): the video and audio velocities `[1, n, features]` in the order of
    `video_indices` and `audio_indices`. `return_dict` is accepted and ignored (always a tuple)."""
    seq, clocks, order = diffusers_sequence(
        model, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
        token_tags, position_ids, video_indices, audio_indices, text_indices,
    )
    out = model(seq, clocks)
    return order(SegmentKind.VIDEO, out[SegmentKind.VIDEO]), order(SegmentKind.AUDIO, out[SegmentKind.AUDIO])


def _one(x: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    """Drop a leading batch axis of 1 (`rank` is the rank without it)."""
    if x.dim() == rank + 1:
        if x.shape[0] != 1:
            raise ValueError(f"{name} has a batch of {x.shape[0]}; h3 runs one packed sequence (batch 1)")
        return x[0]
    if x.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D (or {rank + 1}-D with a batch of 1), got {list(x.shape)}")
    return x


def diffusers_sequence(
    model: "H3Model",
    hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    timestep_indices: torch.Tensor,
    token_tags: torch.Tensor,
    position_ids: torch.Tensor,
    video_indices: torch.Tensor,
    audio_indices: torch.Tensor,
    text_indices: torch.Tensor,
) -> tuple[PackedSequence, Clocks, Callable[[SegmentKind, torch.Tensor], torch.Tensor]]:
    """The sequence, its clocks, and `order(kind, rows)`: output rows (packed order) in the caller's order, batch 1."""
    inputs = {
        SegmentKind.TEXT: (_one(encoder_hidden_states, 2, "encoder_hidden_states"), text_indices.reshape(-1).long()),
        SegmentKind.VIDEO: (_one(hidden_states, 2, "hidden_states"), video_indices.reshape(-1).long()),
        SegmentKind.AUDIO: (_one(audio_hidden_states, 2, "audio_hidden_states"), audio_indices.reshape(-1).long()),
    }
    total = position_ids.shape[0]
    kind_of = torch.full((total,), -1, dtype=torch.long)
    for code, kind in enumerate(_KINDS):
        rows, index = inputs[kind]
        if rows.shape[0] != index.numel():
            raise ValueError(f"{kind} has {rows.shape[0]} rows but {index.numel()} indices")
        if bool((kind_of[index] != -1).any()):
            raise ValueError("a row of the packed sequence is listed by two of text/video/audio_indices")
        kind_of[index] = code
    if bool((kind_of == -1).any()):
        raise ValueError("every row of the packed sequence must be a text, video or audio row")
    segments = _segments(kind_of, token_tags.reshape(-1).long().cpu(), timestep_indices.reshape(-1).long().cpu())
    orders = {kind: torch.argsort(inputs[kind][1]) for kind in _KINDS}
    features = {kind: inputs[kind][0][orders[kind]] for kind in (SegmentKind.VIDEO, SegmentKind.AUDIO)}
    text = model.refine_text(inputs[SegmentKind.TEXT][0])  # attention without RoPE or mask: row order free
    features[SegmentKind.TEXT] = text[orders[SegmentKind.TEXT]]
    rope = rope_table(model.config, position_ids.to(features[SegmentKind.VIDEO].device))
    values = timestep.reshape(-1).float()
    clocks = Clocks(values, {f"t{i}": i for i in range(values.numel())})

    def order(kind: SegmentKind, rows: torch.Tensor) -> torch.Tensor:
        back = torch.empty_like(orders[kind])
        back[orders[kind]] = torch.arange(orders[kind].numel())
        return rows[back.to(rows.device)][None]

    return PackedSequence(segments=segments, features=features, rope=rope), clocks, order


def _segments(kind_of: torch.Tensor, tags: torch.Tensor, tidx: torch.Tensor) -> list[Segment]:
    """Runs of rows sharing (kind, tag, timestep index), in row order."""
    key = torch.stack([kind_of.cpu(), tags, tidx], dim=1)  # [S, 3]
    change = torch.ones(key.shape[0], dtype=torch.bool)
    change[1:] = (key[1:] != key[:-1]).any(dim=1)
    starts = torch.nonzero(change).reshape(-1).tolist() + [key.shape[0]]
    return [
        Segment(_KINDS[int(key[a, 0])], a, b, tag=int(key[a, 1]), clock=f"t{int(key[a, 2])}")
        for a, b in zip(starts[:-1], starts[1:])
    ]

