"""The decode a generate run ends with is decided before any rank starts (`h3core.decode.plan`)."""

from __future__ import annotations

import pytest

from h3core.decode.memory import REAL_AUDIO, REAL_VIDEO, estimate_decode_memory
from h3core.decode.plan import check_decode_memory, plan_decode
from h3core.decode.geometry import geometry_for
from h3core.errors import ConfigError, ResourceLimit


@pytest.fixture(autouse=True)
def no_vae_variables(monkeypatch, tmp_path):
    for name in ("H3_VIDEO_VAE_PATH", "H3_AUDIO_VAE_PATH", "H3_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("H3_MEMORY_CHECK", "1")


def test_a_synthetic_transformer_decodes_with_the_synthetic_vaes():
    plan = plan_decode(None, None, None, synthetic_transformer=True, width=256, height=128, frames=22, device="cpu")
    assert all(choice.path is None for choice in plan.vaes.values())
    assert plan.geometry.frames == 22 and plan.memory.total_bytes > 0 and plan.output_bytes() > 256 * 128 * 22


def test_a_real_transformer_never_falls_back_to_a_random_vae(tmp_path):
    with pytest.raises(ConfigError) as err:
        plan_decode(None, None, tmp_path / "h3.safetensors", synthetic_transformer=False, width=256, height=128, frames=22, device="cpu")
    assert "--video-vae" in str(err.value) and "--no-decode" in str(err.value)


def test_a_decode_that_cannot_fit_is_refused_before_the_run():
    geometry = geometry_for(1280, 704, 141)
    memory = estimate_decode_memory(1280, 704, 141, video=REAL_VIDEO, audio=REAL_AUDIO)
    with pytest.raises(ResourceLimit) as err:
        check_decode_memory(memory, geometry, "cpu", beside_bytes=1 << 50)  # a pipeline held beside it that no host has
    assert "--no-decode" in str(err.value) and "the transformer held beside it" in str(err.value)
