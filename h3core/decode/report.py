"""What a decode reports: the VAEs it ran, its time and memory, and the probe of the mp4 it wrote.

`DecodeReport` is what `decode_to_folder` returns (what `h3 generate` embeds in its report);
`DecodeRunReport` is `h3 decode`'s `report.json` around it. Torch-free.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from h3core.decode.geometry import LatentGeometry
from h3core.media import AUDIO_STEREO, FPS, SAMPLE_RATE
from h3core.decode.memory import DecodeMemory
from h3core.errors import CheckFailed
from h3core.reports.schema import TensorChecksum, Versions, timestamp

SCHEMA_VERSION = 1


class VaeInfo(BaseModel):
    """One VAE as it was loaded."""

    role: Literal["video", "audio"]
    path: str
    found_by: str = Field("", description="Where the path came from: a flag, a variable, beside the transformer, or the embedded synthetic VAE.")
    container: str = Field(description="single file, diffusers folder or MiniMax folder.")
    key_layout: str = Field(description="video: original (MiniMax/Comfy names) or diffusers; audio: folded (Comfy) or weight-norm.")
    synthetic: bool = Field(description="The file says `weights: synthetic` (h3's embedded stand-in).")
    file_dtype: str = Field(description="Float dtypes on disk (the model always runs in float32).")
    latents_stats_from: str = Field(description="Where latents_mean/latents_std came from.")
    parameters: int = Field(description="Parameters loaded (decoder_only: what decoding runs).")
    decoder_only: bool
    config: dict[str, Any] = Field(description="diffusers' config the model was built with (less the latent statistics).")


class Mp4Probe(BaseModel):
    """What the written mp4 holds, read back with PyAV."""

    size_bytes: int
    container: str
    video_streams: int
    audio_streams: int
    video_codec: str
    pixel_format: str
    width: int
    height: int
    fps: float
    frames: int = Field(description="Video packets demuxed (one per frame).")
    video_duration_s: float = Field(description="The video track's duration.")
    audio_codec: str
    audio_profile: str | None
    sample_rate: int
    channels: int
    audio_samples_decoded: int = Field(description="Samples per channel decoded back from the AAC stream (whole 1024-sample AAC frames).")
    audio_duration_s: float = Field(description="The audio track's duration (its edit list: what players play).")
    av_drift_s: float = Field(description="|audio_duration_s - video_duration_s|.")

    def problems(self, geometry: LatentGeometry) -> list[str]:
        """Where the file breaks the contract (H.264 yuv420p 24 fps, AAC stereo 32 kHz, F frames,
        duration F/24 within one frame, A/V drift within one frame): empty when it keeps it."""
        frame = 1 / FPS
        checks = [
            (self.video_streams == 1 and self.audio_streams == 1, f"{self.video_streams} video and {self.audio_streams} audio streams (want 1 and 1)"),
            (self.video_codec == "h264", f"video codec {self.video_codec} (want h264)"),
            (self.pixel_format == "yuv420p", f"pixel format {self.pixel_format} (want yuv420p)"),
            (abs(self.fps - FPS) < 1e-6, f"{self.fps:g} fps (want {FPS})"),
            ((self.width, self.height) == (geometry.width, geometry.height), f"{self.width}x{self.height} (want {geometry.width}x{geometry.height})"),
            (self.frames == geometry.frames, f"{self.frames} frames (want {geometry.frames})"),
            (abs(self.video_duration_s - geometry.duration_s) <= frame, f"video lasts {self.video_duration_s:.4f} s (want {geometry.duration_s:.4f} s within one frame)"),
            (self.audio_codec == "aac", f"audio codec {self.audio_codec} (want aac)"),
            (self.sample_rate == SAMPLE_RATE, f"{self.sample_rate} Hz (want {SAMPLE_RATE})"),
            (self.channels == AUDIO_STEREO, f"{self.channels} audio channels (want {AUDIO_STEREO})"),
            (self.av_drift_s <= frame, f"audio and video differ by {self.av_drift_s:.4f} s (want at most one frame, {frame:.4f} s)"),
        ]
        return [message for ok, message in checks if not ok]


class DecodeTimings(BaseModel):
    load_s: float = Field(description="Reading both VAEs onto the device.")
    video_s: float
    audio_s: float
    mux_s: float = Field(description="H.264 + AAC encoding into the mp4 (in memory).")
    write_s: float = Field(description="Preview, probe and staging the files.")
    total_s: float


class DecodeFiles(BaseModel):
    video: str
    preview: str | None = None
    decoded: str | None = None


class RankDecodeMemory(BaseModel):
    """One rank's memory over its part of the decode."""

    peak_bytes: int = Field(description="The peak over the decode (`peak_memory_kind`).")
    start_bytes: int = Field(description="What the rank held when the decode began (CPU: the process's resident set, its interpreter, torch and the VAEs; CUDA: allocated bytes).")

    @property
    def decode_bytes(self) -> int:
        """The decode's own: its peak above what was there before it."""
        return max(0, self.peak_bytes - self.start_bytes)


class DecodeReport(BaseModel):
    """One decode: latents -> frames and waveform -> video.mp4 (+ preview, + decoded tensors)."""

    schema_version: int = SCHEMA_VERSION
    geometry: LatentGeometry
    latents: dict[str, TensorChecksum] = Field(description="The normalized latents decoded.")
    decoded: dict[str, TensorChecksum] = Field(description="video [3, F, H, W] in [0, 1] and audio [2, 800*T_a] in [-1, 1], before the codecs.")
    video_vae: VaeInfo
    audio_vae: VaeInfo
    weights: str = Field(description="`synthetic` when any weights (VAEs, or the transformer that made the latents) are, else `checkpoint`.")
    device: str
    device_name: str
    dtype: str = "fp32"
    ranks: int = Field(1, description="Ranks the video's tiles were shared out over (the audio on the last).")
    timings: DecodeTimings
    peak_memory_bytes: int = Field(description="The largest rank's peak over the decode.")
    peak_memory_kind: str
    rank_memory: list[RankDecodeMemory] = Field(default_factory=list, description="Each rank's peak and what it held before the decode, rank 0 first.")
    units_per_rank: list[int] = Field(
        default_factory=list,
        description="The video tiles x windows each rank decoded, rank 0 first (the last also decoded the audio; rank 0 takes over some of its units once a decode of the same size has shown how long the audio takes). Empty for one rank.",
    )
    memory_estimate: DecodeMemory
    probe: Mp4Probe
    problems: list[str] = Field(default_factory=list, description="Where the mp4 breaks the contract (a bug if not empty).")
    files: DecodeFiles

    def failure(self) -> CheckFailed | None:
        if not self.problems:
            return None
        return CheckFailed(f"video.mp4 does not keep the mp4 contract: {'; '.join(self.problems)}")

    def memory_line(self) -> str:
        """Each rank's peak, split into what it held before the decode and the decode's own, against
        the estimate of the decode's own (its weights were loaded before the window began):
        'peak 549 MiB = 468 MiB before (the process, torch, the VAEs) + 81 MiB decoding (estimated 62 MiB)'."""
        from h3core.reports.units import format_bytes

        estimate = self.memory_estimate
        own = [max(0, b - estimate.weights_bytes) for b in estimate.rank_bytes] or [estimate.activation_bytes()]
        before = "the process, torch, the VAEs" if self.device == "cpu" else "the VAEs and what else is allocated"
        if len(self.rank_memory) <= 1:
            m = self.rank_memory[0] if self.rank_memory else RankDecodeMemory(peak_bytes=self.peak_memory_bytes, start_bytes=0)
            return (f"peak {format_bytes(m.peak_bytes)} = {format_bytes(m.start_bytes)} before ({before}) + "
                    f"{format_bytes(m.decode_bytes)} decoding (estimated {format_bytes(own[0])})")
        units = [f", {u} units" for u in self.units_per_rank] if len(self.units_per_rank) == len(self.rank_memory) else [""] * len(self.rank_memory)
        ranks = " · ".join(f"r{r}{n} {format_bytes(m.decode_bytes)} (estimated {format_bytes(e)})" for r, (m, e, n) in enumerate(zip(self.rank_memory, own, units)))
        return f"decoding, above what each rank held before ({before}): {ranks}"


class DecodeRunReport(BaseModel):
    """`h3 decode`'s report.json."""

    schema_version: int = SCHEMA_VERSION
    command: str = "decode"
    created: str = Field(default_factory=timestamp)
    latents_file: str
    latents_metadata: dict[str, str] = Field(default_factory=dict)
    report: str = Field(description="Where this report is.")
    versions: Versions
    decode: DecodeReport

    def failure(self) -> CheckFailed | None:
        return self.decode.failure()
