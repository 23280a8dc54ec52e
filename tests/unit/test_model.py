import torch

from h3core.model.config import preset
from h3core.model.dit import (
    H3Model,
    add_gated,
    apply_rope,
    modulate,
    patchify_audio,
    patchify_video,
    rope_table,
    token_positions,
    unpatchify_audio,
    unpatchify_video,
)
from h3core.model.sequence import SegmentKind as K, pack_segments


def test_modulation_is_per_segment():
    segs = pack_segments([(K.TEXT, 2), (K.VIDEO, 3), (K.AUDIO, 1)])
    x = torch.ones(6, 4)
    shift = torch.tensor([[0.0] * 4, [1.0] * 4, [2.0] * 4])
    scale = torch.zeros(3, 4)
    out = modulate(x, segs, shift, scale)
    assert out[:2].eq(1).all() and out[2:5].eq(2).all() and out[5:].eq(3).all()
    y = add_gated(torch.zeros(6, 4), torch.ones(6, 4), segs, torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4]))
    assert y[:, 0].tolist() == [1, 1, 2, 2, 2, 3]


def test_positions_are_3d_for_video_and_1d_for_text_and_audio():
    segs = pack_segments([(K.TEXT, 3), (K.VIDEO, 2 * 2 * 3), (K.AUDIO, 2)])
    pos = token_positions(segs, (2, 2, 3))
    assert pos[:3].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert pos[3].tolist() == [0, 0, 0] and pos[4].tolist() == [0, 0, 1] and pos[6].tolist() == [0, 1, 0]
    assert pos[3 + 6].tolist() == [1, 0, 0]
    assert pos[-2:].tolist() == [[0, 0, 0], [1, 1, 1]]


def test_1d_positions_give_ordinary_rope_over_the_whole_head():
    cfg = preset("tiny")
    segs = pack_segments([(K.TEXT, 5)])
    rope = rope_table(cfg, token_positions(segs, (1, 1, 1)))
    half = cfg.head_dim // 2
    # one frequency per band: theta^(-2i/d_axis) per axis, all applied to the same position p
    p = torch.arange(5, dtype=torch.float64)[:, None]
    freqs = torch.cat([cfg.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) for d in cfg.rope_axes])
    assert rope.cos.shape == (5, half)
    assert torch.allclose(rope.cos.double(), (p * freqs).cos(), atol=1e-6)
    # relative position property: <R(p)q, R(p+k)k> depends on k only
    q, k = torch.randn(1, 1, cfg.head_dim), torch.randn(1, 1, cfg.head_dim)
    dots = [(apply_rope(q, rope.cos[i : i + 1], rope.sin[i : i + 1]) * apply_rope(k, rope.cos[i + 2 : i + 3], rope.sin[i + 2 : i + 3])).sum() for i in range(3)]
    assert torch.allclose(torch.stack(dots), dots[0].expand(3), atol=1e-5)


def test_patchify_round_trips():
    v = torch.randn(4, 3, 6, 8)
    tokens = patchify_video(v, (1, 2, 2))
    assert tokens.shape == (3 * 3 * 4, 16)
    assert torch.equal(tokens[1], v[:, 0, 0:2, 2:4].reshape(-1))  # second token: t=0, h=0, w=1
    assert torch.equal(unpatchify_video(tokens, v.shape, (1, 2, 2)), v)
    a = torch.randn(4, 10)
    assert torch.equal(unpatchify_audio(patchify_audio(a, 2), a.shape, 2), a)


def test_h3_preset_on_meta_counts_parameters_and_nvfp4_bytes():
    model = H3Model(preset("h3"))
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    from h3core.model.checkpoint import nvfp4_prefixes, schema

    specs = schema(preset("h3"))
    nvfp4 = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in specs if s.nvfp4)
    assert nvfp4 == 12_507_071_280
    assert len(nvfp4_prefixes(model)) == 4 + 4 * 50


def _attention_and_inputs(rows: int = 29):
    """The tiny preset's Attention with random NVFP4 weights and norms, and `rows` input rows with RoPE."""
    import torch.nn as nn

    from h3core.model.dit import Attention
    from h3core.nvfp4.linear import NVFP4Linear

    cfg = preset("tiny")
    d, g = cfg.hidden, torch.Generator().manual_seed(0)
    attn = Attention(cfg)
    attn.qkv = NVFP4Linear.from_float(torch.randn(3 * d, d, generator=g), torch.randn(3 * d, generator=g))
    attn.out = NVFP4Linear.from_float(torch.randn(d, d, generator=g))
    for norm in (attn.norm_q, attn.norm_k):
        norm.weight = nn.Parameter(torch.rand(cfg.head_dim, generator=g) + 0.5, requires_grad=False)
    h = torch.randn(rows, d, generator=g)
    rope = rope_table(cfg, torch.arange(rows)[:, None].expand(rows, 3).float())
    return attn, h, rope


def test_attention_with_v_computed_apart_is_bitwise_the_fused_qkv(monkeypatch):
    """On the dequant paths Attention leaves v to its GEMM (`LinearHeads`, which Ulysses points at
    its send blocks); on one rank that gives bitwise what the fused q|k|v GEMM gives."""
    from h3core.model.dit import LinearHeads
    from h3core.nvfp4.linear import NVFP4Linear

    attn, h, rope = _attention_and_inputs()
    assert isinstance(attn._project(h)[2], LinearHeads)
    apart = attn(h, rope)
    monkeypatch.setattr(NVFP4Linear, "rows_apart", property(lambda self: False))  # as on the fp4 paths
    assert not isinstance(attn._project(h)[2], LinearHeads)
    assert torch.equal(attn(h, rope), apart)


def test_attention_with_rope_in_row_chunks_is_bitwise_one_pass(monkeypatch):
    """The model's RoPE over cache-sized row chunks (the CPU path for big inputs) changes no bit of
    attention's output; forced here on the tiny preset with chunks of 4 rows (29 rows: a ragged last)."""
    from h3core.model import dit

    attn, h, rope = _attention_and_inputs()
    one_pass = attn(h, rope)
    q = torch.empty(29, attn.qkv.out_features // 3 // attn.head_dim, attn.head_dim)
    monkeypatch.setattr(dit, "ROPE_CHUNK_BYTES", 4 * 4 * q[0].numel())
    assert dit.rope_chunk_rows(q) == 4
    assert torch.equal(attn(h, rope), one_pass)
