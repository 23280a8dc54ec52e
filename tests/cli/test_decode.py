"""`h3 decode LATENTS` as a user runs it: the folder it writes, its report, and one line for every
mistake (a bad VAE file, latents of the wrong shape, a full disk), leaving nothing behind."""

from __future__ import annotations

import ast
import errno
import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import h3core.reports.outputs as outputs_module
from commands import h3_process, one_line


@pytest.fixture(autouse=True)
def no_vae_variables(monkeypatch):
    for name in ("H3_VIDEO_VAE_PATH", "H3_AUDIO_VAE_PATH", "H3_MODEL_PATH"):
        monkeypatch.delenv(name, raising=False)


def _latents_file(path, video=(24, 7, 8, 16), audio=(2, 32, 37), **metadata):
    g = torch.Generator().manual_seed(5)
    save_file({"video": torch.randn(video, generator=g), "audio": torch.randn(audio, generator=g)}, str(path), metadata={"seed": "5", **metadata})
    return path


def _entries(path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def test_h3_decode_writes_the_clip(h3, tmp_path):
    latents = _latents_file(tmp_path / "latents.safetensors", weights="synthetic")
    code, out, err = h3("decode", str(latents), "-o", str(tmp_path / "clip"), "--save-decoded", "--device", "cpu", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert _entries(tmp_path / "clip") == ["decoded.safetensors", "preview.png", "report.json", "video.mp4"]
    assert json.loads((tmp_path / "clip" / "report.json").read_text()) == report
    d = report["decode"]
    assert d["problems"] == [] and d["weights"] == "synthetic"
    probe = d["probe"]
    assert (probe["video_codec"], probe["pixel_format"], probe["fps"], probe["frames"]) == ("h264", "yuv420p", 24.0, 22)
    assert (probe["audio_codec"], probe["sample_rate"], probe["channels"]) == ("aac", 32000, 2)
    assert abs(probe["video_duration_s"] - 22 / 24) <= 1 / 24 and probe["av_drift_s"] <= 1 / 24
    assert report["latents_metadata"] == {"seed": "5", "weights": "synthetic"}
    decoded = load_file(tmp_path / "clip" / "decoded.safetensors")
    assert decoded["video"].shape == (3, 22, 128, 256) and float(decoded["video"].min()) >= 0 and float(decoded["video"].max()) <= 1
    assert decoded["audio"].shape == (2, 29600) and float(decoded["audio"].abs().max()) <= 1


def test_h3_decode_prints_a_table(h3, tmp_path):
    latents = _latents_file(tmp_path / "latents.safetensors")
    code, out, err = h3("decode", str(latents), "-o", str(tmp_path / "clip"))
    assert code == 0, err
    assert "h3 decode" in out and "h264 yuv420p 256x128 24 fps, 22 frames" in out and "aac LC 2 ch 32000 Hz" in out
    assert "the embedded synthetic VAE" in out and err == ""


def test_the_vae_variables_are_read(h3, tmp_path, monkeypatch, cache):
    from h3core.decode.synthetic import synthetic_vae_file

    video, _ = synthetic_vae_file("video")
    copy = tmp_path / "minimax_h3_video_vae_fp16.safetensors"
    copy.write_bytes(video.read_bytes())
    monkeypatch.setenv("H3_VIDEO_VAE_PATH", str(copy))
    code, out, err = h3("decode", str(_latents_file(tmp_path / "l.safetensors")), "-o", str(tmp_path / "clip"), "--json")
    assert code == 0, err
    vae = json.loads(out)["decode"]["video_vae"]
    assert (vae["path"], vae["found_by"]) == (str(copy), "H3_VIDEO_VAE_PATH")


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda p: p.write_bytes(b"garbage"), "--video-vae: {bad} is not a readable safetensors file"),
        (lambda p: save_file({"decoder.conv_pre.weight": torch.zeros(4, 4, 7)}, str(p)), "--video-vae {bad} is the H3 audio VAE, not the video VAE; pass it as --audio-vae"),
        (lambda p: None, "--video-vae {bad} does not exist"),
    ],
    ids=["not-safetensors", "the-audio-vae", "missing"],
)
def test_a_bad_vae_file_is_one_line_and_writes_nothing(h3, tmp_path, make, needle):
    bad = tmp_path / "vae.safetensors"
    make(bad)
    latents = _latents_file(tmp_path / "latents.safetensors")
    code, _, err = h3("decode", str(latents), "--video-vae", str(bad), "-o", str(tmp_path / "clip"))
    assert code == 2 and needle.format(bad=bad) in one_line(err)
    assert not (tmp_path / "clip").exists()


@pytest.mark.parametrize(
    "video, audio, needle",
    [
        ((16, 7, 8, 16), (2, 32, 37), "the video latent has shape [16, 7, 8, 16]; H3's video VAE takes [24, T, H/16, W/16] (24 channels)"),
        ((24, 7, 8, 16), (2, 16, 37), "the audio latent has shape [2, 16, 37]; H3's audio VAE takes [2, 32, T_a]"),
    ],
)
def test_latents_of_the_wrong_channel_count_are_one_line(h3, tmp_path, video, audio, needle):
    latents = _latents_file(tmp_path / "latents.safetensors", video, audio)
    code, _, err = h3("decode", str(latents), "-o", str(tmp_path / "clip"))
    assert code == 2 and needle in one_line(err)
    assert not (tmp_path / "clip").exists()


def test_a_latents_file_without_the_audio_is_one_line(h3, tmp_path):
    save_file({"video": torch.zeros(24, 7, 8, 16)}, str(tmp_path / "l.safetensors"))
    code, _, err = h3("decode", str(tmp_path / "l.safetensors"))
    assert code == 2 and "has no 'audio' tensor (it has video)" in one_line(err)


@pytest.mark.parametrize("video_dtype, audio_dtype, needle", [
    (torch.int64, torch.float32, "the video latent is I64, not a float tensor"),
    (torch.float32, torch.bool, "the audio latent is BOOL, not a float tensor"),
    (torch.uint8, torch.uint8, "the video latent is U8"),
    (torch.int32, torch.float32, "the video latent is I32"),
    (torch.float8_e4m3fn, torch.float32, "the video latent is F8_E4M3"),
])
def test_integer_boolean_or_fp8_latents_are_refused_before_they_are_converted(h3, tmp_path, video_dtype, audio_dtype, needle):
    """Cast to float first, such latents would pass every later check (finite, shaped) and decode as noise."""
    save_file({"video": torch.ones(24, 7, 8, 16).to(video_dtype), "audio": torch.ones(2, 32, 37).to(audio_dtype)}, str(tmp_path / "l.safetensors"))
    code, out, err = h3("decode", str(tmp_path / "l.safetensors"), "-o", str(tmp_path / "clip"))
    assert code == 2 and needle in one_line(err) and out == ""
    assert _entries(tmp_path) == ["l.safetensors"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_float_latents_of_any_width_are_read(tmp_path, dtype):
    from h3core.decode.command import read_latents

    save_file({"video": torch.ones(24, 7, 8, 16, dtype=dtype), "audio": torch.ones(2, 32, 37, dtype=dtype)}, str(tmp_path / "l.safetensors"))
    latents, _, geometry = read_latents(tmp_path / "l.safetensors")
    assert latents["video"].dtype == torch.float32 and geometry.frames == 22


def test_the_in_memory_check_refuses_the_same_dtypes():
    from h3core.decode.run import check_latents
    from h3core.errors import ConfigError

    with pytest.raises(ConfigError, match="the video latent is int64, not a float tensor"):
        check_latents({"video": torch.ones(24, 7, 8, 16, dtype=torch.int64), "audio": torch.ones(2, 32, 37)}, "x")
    with pytest.raises(ConfigError, match="the audio latent is bool, not a float tensor"):
        check_latents({"video": torch.ones(24, 7, 8, 16), "audio": torch.ones(2, 32, 37, dtype=torch.bool)}, "x")


def test_a_full_disk_is_one_line_and_leaves_no_partial_mp4(h3, tmp_path, monkeypatch):
    real = outputs_module.write_atomic

    def full_at_the_video(path, data):
        if path.name == "video.mp4":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(outputs_module, "write_atomic", full_at_the_video)
    latents = _latents_file(tmp_path / "latents.safetensors")
    code, _, err = h3("decode", str(latents), "-o", str(tmp_path / "clip"))
    assert code == 1 and "video.mp4: no space left on the device; nothing was written" in one_line(err)
    assert _entries(tmp_path) == ["latents.safetensors"]


def test_h3_decode_as_a_process(tmp_path, cache):
    """A real process: exit 0, the files; and `h3 --help` imports neither diffusers nor PyAV, and the
    decode command's own modules not torch either (the VAEs and the codecs load when a decode starts)."""
    latents = _latents_file(tmp_path / "latents.safetensors")
    done = h3_process("decode", str(latents), "-o", str(tmp_path / "clip"), "--json", env={"H3_CACHE_DIR": cache})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decode"]["files"]["video"] == str(tmp_path / "clip" / "video.mp4")
    import subprocess

    def loaded(statement: str) -> list[str]:
        probe = f"import sys; {statement}; print([m for m in ('torch', 'diffusers', 'av') if m in sys.modules])"
        return ast.literal_eval(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip())

    assert loaded("import h3cli.decode, h3core.decode.command, h3core.decode.memory") == []
    assert set(loaded("from h3cli.main import app")) <= {"torch"}
