"""The VAEs are built without initializing a weight (issue 35.2), the video VAE on the meta device
(nothing allocated; the buffers its class computes made by diffusers' own code), and what loads is
bitwise what diffusers' own construction and `from_pretrained` give: every tensor, the
non-persistent RoPE frequencies included, and one decode."""

from __future__ import annotations

import pytest
import torch

from h3core.decode import video_vae
from h3core.decode.load import build_model, load_vae
from h3core.decode.synthetic import CONFIGS, synthetic_model
from h3core.decode.vae_files import find_vae_files

ROLES = ("video", "audio")


def _class(role: str):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    return AutoencoderKLMiniMaxH3 if role == "video" else AutoencoderKLMiniMaxH3Audio


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each synthetic VAE as diffusers' own folder (`save_pretrained`)."""
    root = tmp_path_factory.mktemp("meta-vaes")
    for role in ROLES:
        synthetic_model(role, seed=11).save_pretrained(root / role)
    return {role: root / role for role in ROLES}


@pytest.mark.parametrize("role", ROLES)
def test_the_build_allocates_no_video_weight_and_computes_diffusers_buffers(role):
    built = build_model(role, CONFIGS[role])
    # the video VAE on meta; the audio VAE on the CPU, uninitialized (its meta build is 6x slower)
    assert all(p.is_meta == (role == "video") for p in built.parameters())
    torch.manual_seed(0)
    reference = _class(role)(**{k: v for k, v in CONFIGS[role].items() if k in built.config})  # diffusers' own constructor, on the CPU
    ours, theirs = dict(built.named_buffers()), dict(reference.named_buffers())  # non-persistent ones too
    assert sorted(ours) == sorted(theirs) and ours
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    persistent = set(built.state_dict())
    assert {k for k in ours if k in persistent} == {k for k in theirs if k in reference.state_dict()}


@pytest.mark.parametrize("role", ROLES)
def test_loaded_vae_is_diffusers_from_pretrained_bitwise_buffers_and_decode(folders, role):
    loaded = load_vae(find_vae_files(folders[role], role, "--test"), decoder_only=False).model
    reference = _class(role).from_pretrained(folders[role]).eval()
    if role == "audio":
        from h3core.decode.audio_vae import fold_weight_norm

        fold_weight_norm(reference)  # what h3 runs: the weight diffusers' hook computes, folded once
    ours = {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}
    theirs = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    assert not any(t.is_meta for t in ours.values())
    shape = (1, 24, 7, 4, 4) if role == "video" else (1, 32, 9)
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(loaded.decode(z).sample, reference.decode(z).sample)


def test_a_buffer_nobody_computes_is_an_error_naming_it(folders, monkeypatch):
    """The mutation check: without `compute_buffers` the RoPE frequencies stay on meta, and the load says so."""
    monkeypatch.setattr(video_vae, "compute_buffers", lambda model: None)
    with pytest.raises(RuntimeError, match=r"decoder\.rope\.inv_freq.*diffusers' class has changed"):
        load_vae(find_vae_files(folders["video"], "video", "--test"))
