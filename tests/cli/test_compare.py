"""`h3 compare A B`: the figures on inputs whose answer is known, and the command's one-line refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from h3core.decode.compare import _luma, _ssim, distance
from h3core.decode.mp4 import encode_mp4


def _frames(seed: int = 0, n: int = 3) -> torch.Tensor:
    return torch.randint(0, 200, (n, 32, 48, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _sound(n: int = 3200) -> torch.Tensor:
    t = torch.arange(n, dtype=torch.float64) / 32000
    return torch.stack([torch.sin(2 * math.pi * 440 * t), torch.sin(2 * math.pi * 660 * t)]).float() * 0.5


def test_identical_clips_are_infinite_psnr_and_ssim_one():
    d = distance(_frames(), _sound(), _frames(), _sound())
    assert d.identical and d.psnr_db is None and d.audio_snr_db is None and d.ssim == pytest.approx(1.0)


def test_a_known_error_gives_the_known_figures():
    a, sound = _frames(), _sound()
    d = distance(a, sound, a + 5, sound * 1.1)  # every pixel off by 5; the audio by a tenth of itself
    assert d.psnr_db == pytest.approx(10 * math.log10(255**2 / 25)) and d.psnr_worst_frame_db == pytest.approx(d.psnr_db)
    assert d.audio_snr_db == pytest.approx(20.0, abs=1e-4) and not d.identical
    assert distance(a, sound, a + 20, sound).psnr_db < d.psnr_db  # more error, lower PSNR


def test_ssim_of_flat_frames_is_the_luminance_term():
    x, y = torch.full((16, 16), 100.0, dtype=torch.float64), torch.full((16, 16), 110.0, dtype=torch.float64)
    c1 = (0.01 * 255) ** 2
    assert float(_ssim(x, y)) == pytest.approx((2 * 100 * 110 + c1) / (100**2 + 110**2 + c1))
    noisy = _luma(_frames(1)[0])
    assert float(_ssim(noisy, noisy)) == pytest.approx(1.0) and float(_ssim(noisy, _luma(_frames(2)[0]))) < 0.5


def _write(path, frames: torch.Tensor) -> None:
    path.write_bytes(encode_mp4(frames.numpy(), np.tile(_sound(frames.shape[0] * 32000 // 24).numpy(), 1)))


def test_the_command_compares_two_files_and_refuses_what_it_cannot(h3, tmp_path):
    _write(tmp_path / "a.mp4", _frames(0, 5))
    _write(tmp_path / "b.mp4", _frames(3, 5))
    _write(tmp_path / "small.mp4", _frames(0, 5)[:, :16])
    code, out, err = h3("compare", str(tmp_path / "a.mp4"), str(tmp_path / "a.mp4"))
    assert code == 0 and "inf (identical)" in out and "SSIM 1.0000" in out
    code, out, err = h3("compare", str(tmp_path / "a.mp4"), str(tmp_path / "b.mp4"), "--json")
    assert code == 0 and '"identical": false' in out and '"psnr_db": ' in out
    for args, needle in [((tmp_path / "a.mp4", tmp_path / "small.mp4"), "differ in shape"), ((tmp_path / "a.mp4", tmp_path / "none.mp4"), "no such file"),
                         ((tmp_path / "a.mp4", tmp_path), "a folder without video.mp4")]:
        code, out, err = h3("compare", *map(str, args))
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "bad.mp4").write_bytes(b"not an mp4 at all" * 10)
    code, out, err = h3("compare", str(tmp_path / "a.mp4"), str(tmp_path / "bad.mp4"))
    assert code == 2 and "not a readable mp4" in err
