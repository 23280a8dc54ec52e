"""`decode_to_folder`, what `h3 generate` calls: the staged files, the report, and nothing partial
when the disk fills (an injected ENOSPC, and a real full tmpfs where this machine lets us mount one)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import h3core.reports.outputs as outputs_module
from h3core.decode.run import Decoders, decode_audio, decode_to_folder, decode_video
from h3core.decode.sources import choose_vaes
from h3core.errors import ConfigError, OutputError
from h3core.reports.outputs import Outputs


@pytest.fixture(autouse=True)
def vae_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "vae-cache"))
    for name in ("H3_VIDEO_VAE_PATH", "H3_AUDIO_VAE_PATH", "H3_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)


def _latents(seed: int = 0, frames: int = 7):
    g = torch.Generator().manual_seed(seed)
    audio = round((17 * ((frames - 2) // 5) + 5) * 40 / 24)
    return {"video": torch.randn(24, frames, 8, 16, generator=g), "audio": torch.randn(2, 32, audio, generator=g)}


def _entries(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_decode_to_folder_stages_the_clip(tmp_path):
    latents = _latents()
    with Outputs() as outputs:
        folder = outputs.folder(tmp_path / "run", kind="generate")
        report = decode_to_folder(latents, folder, device="cpu", save_decoded=True, synthetic_label=True, title="test")
        assert not (tmp_path / "run").exists()  # staged, not yet published
        outputs.publish()
    assert _entries(tmp_path / "run") == ["decoded.safetensors", "preview.png", "video.mp4"]
    assert report.problems == [] and report.failure() is None and report.weights == "synthetic"
    assert (report.probe.frames, report.probe.width, report.probe.height) == (22, 256, 128)
    assert report.video_vae.synthetic and report.video_vae.found_by == "the embedded synthetic VAE"
    assert report.timings.total_s > 0 and report.peak_memory_bytes > 0
    decoded = load_file(tmp_path / "run" / "decoded.safetensors")
    assert decoded["video"].shape == (3, 22, 128, 256) and decoded["audio"].shape == (2, 37 * 800)
    decoders = Decoders.load(device="cpu")  # the same VAEs again: the saved tensors are the decode
    assert torch.equal(decoded["video"], decode_video(decoders.video, latents["video"]))
    assert torch.equal(decoded["audio"], decode_audio(decoders.audio, latents["audio"]))


def test_a_latent_with_the_wrong_channels_is_one_line(tmp_path):
    latents = _latents()
    latents["video"] = latents["video"][:16]
    with Outputs() as outputs:
        folder = outputs.folder(tmp_path / "run", kind="generate")
        with pytest.raises(ConfigError, match=r"the video latent has shape \[16, 7, 8, 16\]; H3's video VAE takes \[24, T, H/16, W/16\]"):
            decode_to_folder(latents, folder, device="cpu")
    assert _entries(tmp_path) == []


def test_non_finite_latents_are_refused(tmp_path):
    latents = _latents()
    latents["audio"][0, 0, 0] = float("nan")
    with Outputs() as outputs, pytest.raises(ConfigError, match="the audio latent holds NaN or infinite values"):
        decode_to_folder(latents, outputs.folder(tmp_path / "run", kind="generate"), device="cpu")


def test_a_full_disk_at_the_mp4_leaves_nothing(tmp_path, monkeypatch):
    real = outputs_module.write_atomic

    def full_at_the_video(path, data):
        if path.name == "video.mp4":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(outputs_module, "write_atomic", full_at_the_video)
    with pytest.raises(OutputError, match=r"cannot write .*video.mp4: no space left on the device; nothing was written"):
        with Outputs() as outputs:
            decode_to_folder(_latents(), outputs.folder(tmp_path / "run", kind="generate"), device="cpu")
    assert _entries(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (root and CAP_SYS_ADMIN only; else the test is skipped: the injected ENOSPC above always runs)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_leaves_no_partial_mp4(small_tmpfs, monkeypatch):
    """The free-space check passes, then something else fills the disk while the clip decodes:
    writing video.mp4 meets a real ENOSPC and the folder is gone without a trace."""
    real_decode = Decoders.decode

    def decode_then_fill(self, *args, **kwargs):
        decoded = real_decode(self, *args, **kwargs)
        with open(small_tmpfs / "ballast", "wb") as f:  # leave less than the mp4 needs
            while os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize > 64 * 1024:
                f.write(b"\0" * 32 * 1024)
        return decoded

    monkeypatch.setattr(Decoders, "decode", decode_then_fill)
    monkeypatch.setattr(outputs_module, "MARGIN_BYTES", 0)
    with pytest.raises(OutputError, match=r"video.mp4: no space left on the device; nothing was written"):
        with Outputs() as outputs:
            decode_to_folder(_latents(), outputs.folder(small_tmpfs / "run", kind="generate"), device="cpu")
    assert _entries(small_tmpfs) == ["ballast"]


def test_vaes_are_chosen_flag_variable_beside_synthetic(tmp_path, monkeypatch):
    root = tmp_path / "MiniMax-H3"
    for name in ("transformer", "vae", "audio_vae"):
        (root / name).mkdir(parents=True)
    chosen = choose_vaes(None, tmp_path / "mine.safetensors", root / "transformer")
    assert (chosen["video"].path, chosen["audio"].path) == (root / "vae", tmp_path / "mine.safetensors")
    assert chosen["video"].found_by.startswith("beside the transformer") and chosen["audio"].found_by == "--audio-vae"
    monkeypatch.setenv("H3_VIDEO_VAE_PATH", str(tmp_path / "env.safetensors"))
    assert choose_vaes(None, None, root)["video"].found_by == "H3_VIDEO_VAE_PATH"
    assert choose_vaes(None, None, None)["audio"].path is None  # synthetic
    with pytest.raises(ConfigError, match=r"no audio VAE for the checkpoint .*: pass --audio-vae \(e.g. minimax_h3_audio_vae_fp32.safetensors\)"):
        choose_vaes(None, None, tmp_path / "dit.safetensors", allow_synthetic=False)
