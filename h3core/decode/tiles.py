"""The video VAE's tiled decode cut into units any rank can run, and put back together bit for bit.

diffusers 0.42.1's `AutoencoderKLMiniMaxH3._decode` decodes a latent in temporal windows of 7 latent
frames (5 new plus the 2 the next window shares), each window in spatial tiles of 256 px laid out
by the model's `_split_tiles`; every (window, tile) pair is one `decoder(post_quant_conv(...))` call
that depends on nothing else. Then the tiles of a window are blended over their overlaps (row over
the tile above, then column over the raw tile to the left), and the windows are cross-faded over
their shared frames. That is what `VideoTiles` reproduces:

- `unit(z, k)` runs unit k (window-major, then tile rows, then columns) exactly as diffusers does
  (the same slices of the same tensor), keeping only the frames the decode uses (a window's first 3
  frames and the 3 after its 17th are padding the decode drops);
- `assemble(units)` blends them into the clip [3, F, H, W] with the same float32 expressions, in
  the same order, written straight into one output (no concatenation of concatenations).

So a decode whose units ran anywhere -- one rank, or shared out (`h3core.decode.spread`) -- is
`torch.equal` to `model.decode` (tests/unit/test_decode_tiles.py, tests/dist/test_decode_spread.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Axis:
    """Tiles along one axis, in pixels: where each starts, its length, the overlap after each but the last."""

    starts: tuple[int, ...]
    length: int
    overlaps: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.starts)

    def kept(self, i: int) -> int:
        """Pixels of tile i in the clip: its length less the overlap the next tile blends over."""
        return self.length - (self.overlaps[i] if i < self.count - 1 else 0)


def blend_weights(extent: int, like: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(1 - p / extent, p / extent) for p = 0..extent-1: diffusers' `_blend` ramps, in `like`'s dtype and device."""
    import torch

    positions = torch.arange(extent, device=like.device, dtype=like.dtype)
    return 1 - positions / extent, positions / extent


@dataclass(frozen=True)
class VideoTiles:
    """One latent's video decode as units: `windows` x `rows.count` x `cols.count` decoder calls."""

    windows: int
    window_latents: int
    """Latent frames each window decodes (7: 5 new, 2 shared with the next)."""
    new_latents: int
    """Latent frames a window advances by (5)."""
    rows: Axis
    cols: Axis
    stride: int
    """Pixels per latent (16)."""
    head: tuple[int, int]
    """Frames [start, end) of a decoded window that are its own (3..20: 17 frames)."""
    tail: tuple[int, int]
    """Frames [start, end) of a decoded window that the next window cross-fades with (23..28: 5 frames)."""

    @classmethod
    def of(cls, model: "torch.nn.Module", latent_frames: int, latent_height: int, latent_width: int) -> "VideoTiles":
        """The units of decoding a [24, `latent_frames`, h, w] latent with `model` (diffusers'
        `AutoencoderKLMiniMaxH3`, tiling on, as H3 ships it), read from the model's own settings."""
        chunk, drop, ratio = model.tokens_chunk_size, model.config.token_drop, model.temporal_compression_ratio
        if not model.use_tiling or drop <= 0 or (latent_frames + drop) % chunk:
            raise ValueError(f"{latent_frames} latent frames do not decode in whole windows of {chunk} with {drop} dropped (H3's geometry: 5n+2)")
        pre, window_frames = model.frame_pre_padding, (chunk + model.token_overlap) * ratio
        head, tail = (pre, chunk * ratio), (chunk * ratio + pre, window_frames)
        if model.frame_overlap != tail[1] - tail[0] or model.frame_overlap > head[1] - head[0]:
            raise ValueError("the video VAE's window overlap is not its kept tail; not H3's temporal geometry")
        s = model.spatial_compression_ratio

        def axis(pixels: int, tile: int, overlap: int) -> Axis:
            starts, lengths, overlaps = model._split_tiles(pixels, tile, overlap)
            return Axis(tuple(starts), lengths[0], tuple(overlaps))

        return cls(
            windows=(latent_frames + drop) // chunk - 1, window_latents=chunk + model.token_overlap, new_latents=chunk,
            rows=axis(latent_height * s, model.tile_sample_min_height, model.tile_sample_min_overlap_height),
            cols=axis(latent_width * s, model.tile_sample_min_width, model.tile_sample_min_overlap_width),
            stride=s, head=head, tail=tail,
        )

    # --- the units -------------------------------------------------------------------------------------

    @property
    def count(self) -> int:
        return self.windows * self.rows.count * self.cols.count

    def where(self, k: int) -> tuple[int, int, int]:
        """Unit k as (window, tile row, tile column)."""
        window, tile = divmod(k, self.rows.count * self.cols.count)
        return (window, *divmod(tile, self.cols.count))

    @property
    def kept_frames(self) -> int:
        return (self.head[1] - self.head[0]) + (self.tail[1] - self.tail[0])

    def unit_shape(self) -> tuple[int, int, int, int]:
        """What `unit` returns: [3, kept frames, tile height, tile width]."""
        return (3, self.kept_frames, self.rows.length, self.cols.length)

    def unit(self, model: "torch.nn.Module", z: "torch.Tensor", k: int) -> "torch.Tensor":
        """Decode unit k of `z` ([1, 24, T, h, w], de-normalized) as diffusers' `_decode_clip` does
        its tile: [3, kept frames, tile h, tile w], the window's padding frames left out."""
        import torch

        window, i, j = self.where(k)
        start, s = window * self.new_latents, self.stride
        clip = z[:, :, start : start + self.window_latents]
        y, x = self.rows.starts[i] // s, self.cols.starts[j] // s
        tile = clip[..., y : y + self.rows.length // s, x : x + self.cols.length // s]
        out = model.decoder(model.post_quant_conv(tile))[0]
        return torch.cat([out[:, self.head[0] : self.head[1]], out[:, self.tail[0] : self.tail[1]]], dim=1)

    # --- putting them together ---------------------------------------------------------------------------

    def frames(self) -> int:
        return self.windows * (self.head[1] - self.head[0]) + (self.tail[1] - self.tail[0])

    def window_units(self, window: int) -> range:
        per_window = self.rows.count * self.cols.count
        return range(window * per_window, (window + 1) * per_window)

    def assemble(self, unit: Callable[[int], "torch.Tensor"], like: "torch.Tensor") -> "torch.Tensor":
        """The clip [3, F, H, W] (dtype and device of `like`) from every unit's output, asked for window
        by window (`unit(k)`; one window's units are held at a time), blended as diffusers blends them:
        tiles within a window, then each window's first frames with the previous window's tail."""
        import torch

        height = self.rows.starts[-1] + self.rows.length
        width = self.cols.starts[-1] + self.cols.length
        out = torch.empty((3, self.frames(), height, width), dtype=like.dtype, device=like.device)
        fade_a, fade_b = (w.view(1, -1, 1, 1) for w in blend_weights(self.tail[1] - self.tail[0], like))
        for window in range(self.windows):
            self._window(window, [unit(k) for k in self.window_units(window)], out, (fade_a, fade_b))  # the previous window's units are gone by now
        return out

    def _window(self, window: int, tiles: Sequence["torch.Tensor"], out: "torch.Tensor", fade: tuple["torch.Tensor", "torch.Tensor"]) -> None:
        """Window `window`'s tiles into `out`: its own frames, and its first ones cross-faded with the previous window's tail."""
        import torch

        own, shared = self.head[1] - self.head[0], self.tail[1] - self.tail[0]
        at = window * own
        if window == 0:
            self._stitch(tiles, slice(0, own + shared), out[:, : own + shared])
            return
        self._stitch(tiles, slice(shared, own + shared), out[:, at + shared : at + own + shared])
        faded = torch.empty_like(out[:, at : at + shared])
        self._stitch(tiles, slice(0, shared), faded)
        out[:, at : at + shared] = out[:, at : at + shared] * fade[0] + faded * fade[1]

    def _stitch(self, tiles: Sequence["torch.Tensor"], frames: slice, into: "torch.Tensor") -> None:
        """Frames `frames` of one window's tiles, blended (diffusers' `_stitch_tiles`), into `into` [3, f, H, W]."""
        cols = self.cols.count
        for i in range(self.rows.count):
            for j in range(cols):
                y, x = self.rows.starts[i], self.cols.starts[j]
                h, w = self.rows.kept(i), self.cols.kept(j)
                dest = into[..., y : y + h, x : x + w]
                tile = tiles[i * cols + j][:, frames]
                dest.copy_(tile[..., :h, :w])
                if i > 0:  # over the raw tile above
                    self._blend(dest, tiles[(i - 1) * cols + j][:, frames][..., :, :w], tile[..., :, :w], self.rows.overlaps[i - 1], dim=-2)
                if j > 0:  # over the raw tile to the left (of the row-blended values)
                    self._blend(dest, tiles[i * cols + j - 1][:, frames][..., :h, :], dest, self.cols.overlaps[j - 1], dim=-1)

    @staticmethod
    def _blend(dest: "torch.Tensor", above: "torch.Tensor", below: "torch.Tensor", extent: int, dim: int) -> None:
        """dest's first `extent` rows (dim -2) or columns (dim -1) = the end of `above` x (1 - p/extent) +
        the start of `below` x p/extent; only those within `dest` are written (the rest is cut off)."""
        weight_a, weight_b = blend_weights(extent, dest)
        span = min(extent, dest.shape[dim])
        shape = [1] * dest.ndim
        shape[dim] = span
        a = above.narrow(dim, above.shape[dim] - extent, span)
        b = below.narrow(dim, 0, span)
        dest.narrow(dim, 0, span).copy_(a * weight_a[:span].view(shape) + b * weight_b[:span].view(shape))


def shares(units: int, ranks: int, shift: int = 0) -> list[range]:
    """Units 0..units-1 in contiguous runs, one per rank, as even as possible (the first ranks take the
    extra), then `shift` of the last rank's units moved to rank 0 (the last rank also decodes the audio:
    `h3core.decode.spread.Balance`); the shift is clamped to what the last rank has."""
    base, extra = divmod(units, ranks)
    sizes = [base + (rank < extra) for rank in range(ranks)]
    if ranks > 1:
        moved = max(0, min(shift, sizes[-1]))
        sizes[0], sizes[-1] = sizes[0] + moved, sizes[-1] - moved
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def owners(units: int, ranks: int, shift: int = 0) -> list[int]:
    """The rank that decodes each unit (`shares`)."""
    return [rank for rank, share in enumerate(shares(units, ranks, shift)) for _ in share]
