"""The model's pieces on their own, each against diffusers 0.42.1's where it has one."""

import pytest
import torch

from h3core.model.config import VideoShape, audio_latents, latent_frames, preset, snap_frames
from h3core.model.dit import (
    Clocks,
    H3Model,
    add_gated,
    curve,
    modulate,
    pack_audio,
    patchify_video,
    rope_table,
    sinusoid,
    unpack_audio,
    unpatchify_video,
)
from h3core.model.positions import position_ids
from h3core.model.rope import apply_rope
from h3core.model.sequence import AUDIO_TAG, TEXT_TAG, VIDEO_TAG, Segment, SegmentKind as K, pack_segments


def test_modulation_reads_each_segments_table_row():
    segs = pack_segments([(K.TEXT, 2), (K.AUDIO, 1), (K.VIDEO, 3)])
    clocks = Clocks.of({"video": 0.5, "audio": 0.25})  # sorted: audio's 0.25 is row 0, video's 0.5 row 1
    rows = [clocks.row(s) for s in segs]
    assert rows == [1 * 3 + TEXT_TAG, 0 * 3 + AUDIO_TAG, 1 * 3 + VIDEO_TAG]
    table_rows = clocks.table_rows(segs)
    assert table_rows.tolist() == [4, 4, 2, 3, 3, 3]  # each row its segment's
    shift = torch.arange(6.0)[:, None].expand(6, 4)
    out = modulate(torch.ones(6, 4), table_rows, torch.stack([shift, torch.full((6, 4), 2.0)], dim=1))
    assert out[:, 0].tolist() == [6, 6, 4, 5, 5, 5]  # 1 * 2 + shift[row] (the table holds 1 + scale)
    y = add_gated(torch.zeros(6, 4), torch.ones(6, 4), table_rows, shift)
    assert y[:, 0].tolist() == [4, 4, 2, 3, 3, 3]  # 0 + gate[row] * 1


def test_equal_timesteps_share_one_table_row():
    clocks = Clocks.of({"video": 0.0, "audio": 0.0})  # step 0 of every schedule
    assert clocks.values.tolist() == [0.0] and clocks.index == {"video": 0, "audio": 0}


def test_frame_and_latent_arithmetic():
    assert [snap_frames(f) for f in (1, 5, 6, 22, 23, 140, 141, 142)] == [5, 5, 22, 22, 39, 141, 141, 158]
    assert (latent_frames(141), latent_frames(243), audio_latents(141), audio_latents(243)) == (42, 72, 235, 405)
    shape = VideoShape.of(864, 480, 141, preset("h3"))
    assert (shape.grid, shape.video_rows, shape.audio_rows) == ((42, 15, 27), 17_010, 470)
    assert preset("h3").num_tokens(864, 480, 141, 100) == 100 + 17_480
    assert VideoShape.of(864, 480, 140, preset("h3")).frames == 141  # snapped up


def test_positions_equal_diffusers_layout():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    cfg = preset("h3")
    for width, height, frames, text in ((864, 480, 141, 11), (256, 128, 22, 3), (448, 320, 22, 0)):
        shape = cfg.video_shape(width, height, frames)
        segments = cfg.segments(width, height, frames, text)
        expected = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.ones(text, dtype=torch.long), shape.latent_frames, shape.latent_height, shape.latent_width,
            shape.audio_latents, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG,
        )
        assert torch.equal(position_ids(segments, shape), expected[0])  # float64, bit for bit
        tags = torch.cat([torch.full((len(s),), s.tag) for s in segments])
        assert torch.equal(tags, expected[1])
        assert [s.kind for s in segments] == ([K.TEXT] if text else []) + [K.AUDIO, K.VIDEO]


@pytest.mark.parametrize("anchors", [("first",), ("last",), ("first", "last")], ids=["first", "last", "first+last"])
def test_keyframe_positions_and_tags_equal_diffusers_layout(anchors):
    """FL2VA: text tags with vision blocks at 0, one condition frame per keyframe at its anchor's time,
    bit for bit as diffusers lays them out (the last anchor's pairwise sum included: 72 latent frames)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    cfg = preset("h3")
    for width, height, frames in ((864, 480, 141), (1344, 768, 243), (256, 128, 22)):
        text_tags = [1] * 4 + [0] * 7 + [1] * 3 + [0] * 5 + [1] * 6
        shape = cfg.video_shape(width, height, frames, keyframes=anchors)
        segments = cfg.segments(width, height, frames, len(text_tags), keyframes=len(anchors), text_tags=text_tags)
        expected = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.tensor(text_tags), shape.latent_frames, shape.latent_height, shape.latent_width,
            shape.audio_latents, (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG, keyframe_anchors=anchors,
        )
        positions, token_tags, video_indices, _, _, conditions, _ = expected
        assert torch.equal(position_ids(segments, shape), positions)
        assert torch.equal(torch.cat([torch.full((len(s),), s.tag) for s in segments]), token_tags)
        condition = [s for s in segments if s.kind is K.CONDITION]
        assert len(condition) == 1 and len(condition[0]) == conditions == shape.condition_rows
        assert torch.equal(torch.arange(condition[0].start, condition[0].stop), video_indices[:conditions])
        assert [s.kind for s in segments] == [K.TEXT] * 5 + [K.CONDITION, K.AUDIO, K.VIDEO]


def test_rope_equals_diffusers_and_leaves_the_last_channels_alone():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed, _apply_rotary_emb

    cfg = preset("tiny")  # 16-wide heads, 12 channels rotated
    positions = torch.rand(9, 3, dtype=torch.float64) * 50
    rope = rope_table(cfg, positions)
    cos, sin = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta)(positions)
    assert torch.equal(torch.cat([rope.cos, rope.cos], -1), cos) and torch.equal(torch.cat([rope.sin, rope.sin], -1), sin)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 3, cfg.head_dim).to(dtype)
        ours = apply_rope(x, rope.cos, rope.sin)
        assert torch.equal(ours, _apply_rotary_emb(x[None], cos, sin)[0])
        assert torch.equal(ours[..., cfg.rotary_dim :], x[..., cfg.rotary_dim :])
        into = torch.empty(9, 3, cfg.head_dim, dtype=dtype)
        apply_rope(x, rope.cos, rope.sin, out=into)
        assert torch.equal(into, ours)


def test_timestep_features_equal_diffusers():
    from diffusers.models.embeddings import Timesteps

    t = torch.tensor([0.0, 0.001733, 0.5, 0.8, 1.0])
    assert torch.equal(sinusoid(t, 256), Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)(t))


def test_curve_reads_the_table_between_its_rows():
    table = torch.arange(11.0)[:, None] * torch.tensor([[1.0, -2.0]])  # linear in the row index
    t = torch.tensor([0.0, 0.05, 0.55, 1.0, 1.7, -0.3])
    assert torch.allclose(curve(table, t), torch.stack([t.clamp(0, 1) * 10, t.clamp(0, 1) * -20], 1))


def test_patchify_equals_diffusers_and_round_trips():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    v = torch.randn(24, 3, 6, 8)
    rows = patchify_video(v, (1, 2, 2))
    assert torch.equal(rows, patchify_video_latents(v[None], (1, 2, 2)))
    assert torch.equal(unpatchify_video(rows, tuple(v.shape), (1, 2, 2)), v)
    a = torch.randn(2, 32, 5)
    packed = pack_audio(a)
    assert torch.equal(packed[6], a[1, :, 1]) and torch.equal(unpack_audio(packed), a)  # row = channel * T_a + latent


def test_h3_preset_is_the_seed_files_layout():
    """The synthetic layout of preset h3 is the seed's file: 1,132 tensors, 12,528,520,792 payload bytes
    (the file is 12,528,636,800 with its header), its 200 NVFP4 block linears; the model on meta."""
    from h3core.model.synthetic import synthetic_specs

    model = H3Model(preset("h3"))
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    specs = synthetic_specs(preset("h3"))
    assert len(specs) == 1132 and sum(s.nbytes for s in specs) == 12_528_520_792
    assert len([s for s in specs if s.name.endswith(".comfy_quant")]) == 200
    assert {s.dtype for s in specs if s.name in ("adaln_t_table", "video_patch_proj.weight", "final_layer.audio_out.bias")} == {"F32"}
    assert {s.dtype for s in specs if ".adaln_proj." in s.name} == {"BF16"}
    assert dict((s.name, s.shape) for s in specs)["blocks.7.attn.qkv_proj.weight_scale"] == (21504, 336)


def _attention_and_inputs(rows: int = 29):
    """The tiny preset's Attention with random NVFP4 weights and norms, and `rows` input rows with RoPE."""
    from h3core.model.dit import Attention
    from h3core.nvfp4.linear import NVFP4Linear

    cfg = preset("tiny")
    d, a, g = cfg.hidden, cfg.attention_width, torch.Generator().manual_seed(0)
    attn = Attention(cfg)
    attn.qkv_proj = NVFP4Linear.from_float(torch.randn(3 * a, d, generator=g))
    attn.out_proj = NVFP4Linear.from_float(torch.randn(d, a, generator=g))
    for norm in (attn.q_norm, attn.k_norm):
        norm.weight = torch.rand(cfg.head_dim, generator=g) + 0.5
    h = torch.randn(rows, d, generator=g)
    rope = rope_table(cfg, torch.rand(rows, 3, generator=g) * 20)
    return attn, h, rope


def test_attention_with_v_computed_apart_is_bitwise_the_fused_qkv(monkeypatch):
    """On the dequant paths Ulysses' processor leaves v to its GEMM (`LinearHeads`, which it points at
    its send blocks); finished on one rank that gives bitwise what the model's own processor computes
    from the fused q|k|v GEMM."""
    from h3core.nvfp4.linear import NVFP4Linear
    from h3core.parallel.modes.ulysses import LinearHeads, project_qkv

    attn, h, rope = _attention_and_inputs()

    def apart():
        projected = project_qkv(attn, h, rope)
        return projected, attn.out_proj(attn.processor.kernel(*projected.split()).flatten(1))

    projected, out = apart()
    assert isinstance(projected.v, LinearHeads)
    assert torch.equal(attn(h, rope), out)
    monkeypatch.setattr(NVFP4Linear, "rows_apart", property(lambda self: False))  # as on the fp4 paths
    projected, out = apart()
    assert not isinstance(projected.v, LinearHeads)
    assert torch.equal(attn(h, rope), out)


def test_attention_with_rope_in_row_chunks_is_bitwise_one_pass(monkeypatch):
    """The model's RoPE over cache-sized row chunks (the CPU path for big inputs) changes no bit of
    attention's output; forced here on the tiny preset with chunks of 4 rows (29 rows: a ragged last)."""
    from h3core.model import rope as rope_module

    attn, h, rope = _attention_and_inputs()
    one_pass = attn(h, rope)
    q = torch.empty(29, attn.qkv_proj.out_features // 3 // attn.head_dim, attn.head_dim)
    monkeypatch.setattr(rope_module, "ROPE_CHUNK_BYTES", 4 * 4 * q[0].numel())
    assert rope_module.rope_chunk_rows(q) == 4
    assert torch.equal(attn(h, rope), one_pass)


def test_a_segment_keeps_its_tag_and_clock_when_clipped():
    from h3core.parallel.partition import clip_segments
    from h3core.span import Span

    seg = Segment(K.VIDEO, 10, 20, tag=0, clock="cond")
    (clipped,) = clip_segments([seg], Span(15, 30))
    assert (clipped.start, clipped.stop, clipped.tag, clipped.clock) == (0, 5, 0, "cond")


@pytest.mark.parametrize("frames", [0, -3])
def test_frames_below_one_are_refused(frames):
    from h3core.errors import ConfigError

    with pytest.raises(ConfigError, match="frames must be at least 1"):
        snap_frames(frames)
