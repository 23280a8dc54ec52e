"""The decode on CUDA: the same frames and waveform as diffusers' decode steps on the GPU, the mp4
contract, and a peak inside the memory estimate. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from h3core.decode.memory import AudioDecoderSize, VideoDecoderSize, estimate_decode_memory
from h3core.decode.run import Decoders, decode_audio, decode_to_folder, decode_video
from h3core.decode.synthetic import CONFIGS, synthetic_model
from h3core.reports.outputs import Outputs
from h3core.reports.schema import error_between

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "vae-cache"))


def test_cuda_decode_equals_diffusers_decode_steps_on_cuda():
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep, MiniMaxH3VideoDecodeStep

    decoders = Decoders.load(device="cuda")
    video_step, audio_step = MiniMaxH3VideoDecodeStep().init_pipeline(), MiniMaxH3AudioDecodeStep().init_pipeline()
    video_step.update_components(vae=synthetic_model("video").cuda())
    audio_step.update_components(audio_vae=synthetic_model("audio").cuda())
    z = torch.randn(24, 12, 24, 20, generator=torch.Generator().manual_seed(0)).cuda()  # 2 windows, 2 x 2 tiles
    a = torch.randn(2, 32, 65, generator=torch.Generator().manual_seed(1)).cuda()
    ours_v, ours_a = decode_video(decoders.video, z), decode_audio(decoders.audio, a)
    ref_v = video_step(latents=z[None], output_type="pt").values["videos"][0].permute(1, 0, 2, 3)
    ref_a = audio_step(audio_latents=a).values["audio"][0]
    for ours, ref in ((ours_v, ref_v), (ours_a, ref_a)):
        max_abs, scale = error_between(ours, ref)
        assert max_abs / scale <= 1e-5
    decoders.release()


def test_a_cuda_decode_keeps_the_contract_and_the_estimate(tmp_path):
    g = torch.Generator().manual_seed(2)
    latents = {"video": torch.randn(24, 42, 30, 54, generator=g).cuda(), "audio": torch.randn(2, 32, 235, generator=g).cuda()}  # 864x480, 141 frames
    with Outputs() as outputs:
        report = decode_to_folder(latents, outputs.folder(tmp_path / "run", kind="decode"), device="cuda")
        outputs.publish()
    assert report.problems == [] and report.probe.frames == 141
    estimate = estimate_decode_memory(864, 480, 141, video=VideoDecoderSize.of(CONFIGS["video"]), audio=AudioDecoderSize.of(CONFIGS["audio"]))
    latents_bytes = sum(t.numel() * 4 for t in latents.values())
    assert report.peak_memory_bytes <= estimate.total_bytes + latents_bytes
