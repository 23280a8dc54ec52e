"""The inputs of an H3 forward, in h3's terms: RoPE angles of the rows held, the clocks (distinct
timesteps) of one step, and a rank's rows of a packed sequence with their latent rows.

Used by the model (`h3core.model.dit`), the diffusers-convention adapter (`h3core.model.packing`)
and the pipeline; torch only, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from h3core.model.config import ModelConfig
from h3core.model.sequence import MODALITIES, Segment, SegmentKind
from h3core.span import Span


@dataclass(frozen=True)
class Rope:
    """RoPE angles of a whole packed sequence, and the rows of it that the activations hold."""

    cos: torch.Tensor  # [N, R/2] float32, R = rotary channels
    sin: torch.Tensor  # [N, R/2]
    rows: Span

    @property
    def num_tokens(self) -> int:
        return self.cos.shape[0]

    def local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `rows` only: [rows, R/2] each."""
        return self.cos[self.rows.start : self.rows.stop], self.sin[self.rows.start : self.rows.stop]

    def whole(self) -> "Rope":
        return replace(self, rows=Span(0, self.num_tokens))

    def select(self, rows: Span) -> "Rope":
        return replace(self, rows=rows)

    def to(self, device: torch.device | str) -> "Rope":
        return replace(self, cos=self.cos.to(device), sin=self.sin.to(device))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """`theta ** -(j / fd)` for j < fd, float32, computed as the reference computes it."""
    fd = config.rope_freq_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, 2 * fd, 2, dtype=torch.float32) / (2 * fd)))


def rope_table(config: ModelConfig, positions: torch.Tensor) -> Rope:
    """Angles of `(t, h, w)` positions `[N, 3]` (any float dtype; taken in float32): `[t f | h f | w f]`."""
    angles = positions.to(torch.float32)[:, :, None] * rope_inv_freq(config).to(positions.device)[None, None]  # [N, 3, fd]
    angles = angles.reshape(positions.shape[0], -1)  # [N, 3 fd]: the t, h, w blocks side by side
    return Rope(cos=angles.cos(), sin=angles.sin(), rows=Span(0, positions.shape[0]))


@dataclass(frozen=True)
class Clocks:
    """The distinct timesteps of one forward (`values`, float32 `[M]`, sorted) and which one each
    clock of the sequence reads (`index`): a row's AdaLN table row is `index[clock] * 3 + tag`."""

    values: torch.Tensor
    index: dict[str, int]

    @classmethod
    def of(cls, times: dict[str, float | torch.Tensor]) -> "Clocks":
        """Clocks of named timesteps (e.g. {'video': t_v, 'audio': t_a}); equal values share a row."""
        stacked = torch.stack([torch.as_tensor(t, dtype=torch.float32).reshape(()) for t in times.values()])
        values, inverse = torch.unique(stacked, sorted=True, return_inverse=True)
        return cls(values, dict(zip(times, inverse.tolist())))

    def to(self, device: torch.device | str) -> "Clocks":
        return replace(self, values=self.values.to(device))

    def row(self, segment: Segment) -> int:
        """The AdaLN table row of `segment`'s rows."""
        return self.index[segment.clock] * MODALITIES + segment.tag

    def table_rows(self, segments: list[Segment], device: torch.device | str = "cpu") -> torch.Tensor:
        """Every row's AdaLN table row, [S] int64 for segments covering rows [0, S) in order: what
        the blocks index their modulation tables with (one gather for all segments)."""
        rows = torch.tensor([self.row(seg) for seg in segments], dtype=torch.long)
        lengths = torch.tensor([len(seg) for seg in segments], dtype=torch.long)
        return torch.repeat_interleave(rows, lengths, output_size=sum(len(seg) for seg in segments)).to(device)


# --- packed inputs -------------------------------------------------------------------------------


@dataclass
class PackedSequence:
    """Rows of a packed sequence, as one rank (or the only rank) holds them.

    `features[kind]` holds that kind's rows in order: text `[n, hidden]` (already refined:
    `H3Model.refine_text`), video `[n, 96]` and audio `[n, 32]` latent rows (float32). `segments`
    are in local row coordinates (0 = first row held); `rope.rows` says where those rows sit.
    """

    segments: list[Segment]
    features: dict[SegmentKind, torch.Tensor]
    rope: Rope


def patchify_video(latent: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[C, T, H, W] -> [T/pt * H/ph * W/pw, C*pt*ph*pw]: rows (t, h, w), feature `c * 4 + ph * 2 + pw`."""
    c, t, h, w = latent.shape
    pt, ph, pw = patch
    x = latent.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape((t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify_video(rows: torch.Tensor, shape: tuple[int, int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of `patchify_video`: [N, C*pt*ph*pw] -> [C, T, H, W]."""
    c, t, h, w = shape
    pt, ph, pw = patch
    x = rows.reshape(t // pt, h // ph, w // pw, c, pt, ph, pw)
    return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(c, t, h, w)


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """[2, C, T_a] -> [2 * T_a, C]: channel-major rows (row = channel * T_a + latent)."""
    return latent.permute(0, 2, 1).reshape(-1, latent.shape[1])


def unpack_audio(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    """Inverse of `pack_audio`: [2 * T_a, C] -> [2, C, T_a]."""
    return rows.reshape(channels, -1, rows.shape[-1]).permute(0, 2, 1)
