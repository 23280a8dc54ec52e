"""Decode H3 latents into `video.mp4`: the two VAEs on one device, then PyAV, staged atomically.

The decode is the reference's (diffusers 0.42.1 `modular_pipelines/minimax_h3/decoders.py`):

- video: z = z_norm * latents_std + latents_mean per channel (24 values from the VAE's config),
  `AutoencoderKLMiniMaxH3.decode` (spatial tiles of 256 px blended over >= 64 px, temporal windows
  of 7 latents cross-faded over 5 frames: both part of the output's semantics, both diffusers'),
  then pixels = clamp(out * ImageNet std + ImageNet mean, 0, 1);
- audio: the same de-normalization with 32 values, `AutoencoderKLMiniMaxH3Audio.decode` with the two
  stereo channels as two batch items (a mono VAE), [2, 1, 800 * T_a] -> [2, samples].

Then the frames (uint8) and the waveform, cut or zero-padded to the video's duration, go into an
H.264 + AAC mp4 made in memory (`h3core.decode.mp4`), which is probed back and checked against the
contract; `video.mp4`, `preview.png` and (asked for) `decoded.safetensors` are staged in the output
folder, which its owner publishes whole.

Entry points: `decode_to_folder` (what `h3 generate` calls on rank 0 once the denoiser is released),
`Decoders` (load once, decode many: batches), `decode_latents_file` (`h3 decode`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping

from h3core.decode.clip import Decoded, Phase, check_latents, no_phase
from h3core.decode.clip import decode_audio, decode_video  # noqa: F401 - their home was here; callers import them from run
from h3core.decode.geometry import LatentGeometry
from h3core.media import FPS, SAMPLE_RATE
from h3core.decode.memory import AudioDecoderSize, VideoDecoderSize, estimate_decode_memory
from h3core.decode.report import DecodeFiles, DecodeReport, DecodeTimings, Mp4Probe, RankDecodeMemory
from h3core.decode.sources import VaeChoice, choose_vaes
from h3core.decode.vae_files import Role

if TYPE_CHECKING:
    import torch

    from h3core.decode.load import LoadedVae
    from h3core.decode.report import VaeInfo
    from h3core.reports.schema import TensorChecksum
    from h3core.reports.outputs import OutputFolder

VIDEO_FILE, PREVIEW_FILE, DECODED_FILE = "video.mp4", "preview.png", "decoded.safetensors"


@contextmanager
def _clock(device: "torch.device", out: dict[str, float], name: str) -> Iterator[None]:
    """Wall time of a block that ends when `device` has finished it."""
    from h3core.runtime.device import synchronize

    synchronize(device)
    started = time.perf_counter()
    yield
    synchronize(device)
    out[name] = time.perf_counter() - started


# --- the loaded decoders -------------------------------------------------------------------------------


class Decoders:
    """Both VAEs loaded on one device: load once, decode many clips, then `release()`."""

    def __init__(self, video: "LoadedVae", audio: "LoadedVae", device: "torch.device", load_s: float):
        self.video, self.audio, self.device, self.load_s = video, audio, device, load_s

    @classmethod
    def load(cls, vaes: Mapping[Role, VaeChoice] | None = None, device: "torch.device | str" = "auto", on_phase: Phase = no_phase) -> "Decoders":
        """Find, check and load both VAEs (`vaes` from `choose_vaes`; None: the variables, else the synthetic VAEs)."""
        from h3core.decode.load import load_vae
        from h3core.decode.synthetic import synthetic_vae_file
        from h3core.decode.vae_files import find_vae_files

        target = _device(device)
        vaes = vaes or choose_vaes(None, None)
        seconds: dict[str, float] = {}
        with _clock(target, seconds, "load"):
            found = {}
            for role in ("video", "audio"):  # both checked before either loads
                path = vaes[role].path if vaes[role].path is not None else synthetic_vae_file(role)[0]
                found[role] = find_vae_files(path, role, vaes[role].source)
            loaded = {}
            for role, files in found.items():
                on_phase(f"loading the {role} VAE")
                loaded[role] = load_vae(files, target)
                loaded[role].info.found_by = vaes[role].found_by
        return cls(loaded["video"], loaded["audio"], target, seconds["load"])

    def decode(self, latents: Mapping[str, "torch.Tensor"], where: str = "the latents", on_phase: Phase = no_phase) -> Decoded:
        """Both latents -> frames and waveform on the CPU (every tile on this device: the one-rank
        case of `h3core.decode.spread`)."""
        from h3core.decode.spread import decode_spread

        decoded, _ = decode_spread(self.video, self.audio, latents, None, where, on_phase)
        assert decoded is not None
        return decoded

    def run(self, latents: Mapping[str, "torch.Tensor"], label: "ClipLabel", where: str = "the latents", on_phase: Phase = no_phase) -> "DecodeRun":
        """`decode` with its memory measured, and the clip encoded: what `write_decode` stages and reports."""
        from h3core.runtime.device import current_memory_bytes, peak_memory_bytes, reset_peak_memory

        started = time.perf_counter()
        reset_peak_memory(self.device)
        start = current_memory_bytes(self.device)
        decoded = self.decode(latents, where, on_phase)
        memory = RankMemory(peak=peak_memory_bytes(self.device), start=start)
        seconds = time.perf_counter() - started
        clip = encode_clip(decoded, label, self.video.info.synthetic or self.audio.info.synthetic, on_phase)
        return DecodeRun(clip, self.video.info, self.audio.info, str(self.device), self.load_s, [memory], seconds)

    def to_folder(
        self, latents: Mapping[str, "torch.Tensor"], folder: "OutputFolder", *, synthetic_label: bool = False, save_decoded: bool = False,
        under: str = "", title: str = "h3", where: str = "the latents", on_phase: Phase = no_phase,
    ) -> DecodeReport:
        """Decode `latents` here and stage video.mp4, preview.png (and decoded.safetensors) in `folder`
        (its subfolder `under`); the report's `failure()` is set if the mp4 breaks the contract."""
        run = self.run(latents, ClipLabel(title, synthetic_label, save_decoded), where, on_phase)
        return write_decode(run, latents, folder, under=under)

    def release(self) -> None:
        """Drop both models and hand their memory back (CUDA: the cached blocks too)."""
        from h3core.runtime.device import release_memory

        self.video.model = self.audio.model = None  # type: ignore[assignment]
        release_memory(self.device.type)


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory over its decode: the peak (`peak_memory_bytes`) and what it held at the start."""

    peak: int
    start: int


@dataclass(frozen=True)
class ClipLabel:
    """What a decoded clip is called and what is kept of it: the preview's title, whether the latents
    came from synthetic weights, and whether decoded.safetensors is written."""

    title: str = "h3"
    synthetic: bool = False
    save_decoded: bool = False


@dataclass
class EncodedClip:
    """A decoded clip as the bytes of its files, made where the clip is (rank 0), with what the report
    says of it: small to send (the mp4 and the preview; decoded.safetensors only when asked for)."""

    geometry: LatentGeometry
    checksums: dict[str, "TensorChecksum"]
    mp4: bytes
    probe: Mp4Probe
    preview: bytes
    decoded: bytes | None
    synthetic: bool
    seconds: dict[str, float]
    """video, audio (the decode), mux (the mp4), write (probe, preview, decoded.safetensors; + staging)."""


def encode_clip(decoded: Decoded, label: ClipLabel, synthetic_vaes: bool, on_phase: Phase = no_phase) -> EncodedClip:
    """The mp4 (H.264 + AAC, probed back), the preview and (asked for) decoded.safetensors of `decoded`."""
    from h3core.decode.mp4 import encode_mp4, probe_mp4
    from h3core.reports.preview import decoded_preview_png
    from h3core.reports.schema import TensorChecksum

    on_phase("writing video.mp4")
    seconds = dict(decoded.seconds)
    started = time.perf_counter()
    mp4 = encode_mp4(decoded.frames_uint8().numpy(), decoded.muxed_audio().numpy())
    seconds["mux"] = time.perf_counter() - started
    synthetic = label.synthetic or synthetic_vaes
    probe = probe_mp4(mp4)
    title = f"{label.title} · {decoded.geometry.describe()}"
    preview = decoded_preview_png(decoded.video, decoded.audio, title, SAMPLE_RATE, FPS, synthetic)
    saved = _decoded_bytes(decoded) if label.save_decoded else None
    checksums = {"video": TensorChecksum.of(decoded.video), "audio": TensorChecksum.of(decoded.audio)}
    seconds["write"] = time.perf_counter() - started - seconds["mux"]
    return EncodedClip(decoded.geometry, checksums, mp4, probe, preview, saved, synthetic, seconds)


@dataclass
class DecodeRun:
    """A finished decode, on one rank or shared out: the encoded clip, the VAEs that made it, where,
    the seconds loading them cost, and each rank's memory (rank 0 first)."""

    clip: EncodedClip
    video_vae: "VaeInfo"
    audio_vae: "VaeInfo"
    device: str
    load_s: float
    memory: list[RankMemory]
    decode_s: float
    """The decode's wall time on rank 0, the other ranks' included (it waits for them)."""
    units: list[int] = field(default_factory=list)
    """The video units each rank decoded, rank 0 first (empty: one rank, every unit)."""


def write_decode(run: DecodeRun, latents: Mapping[str, "torch.Tensor"], folder: "OutputFolder", *, under: str = "") -> DecodeReport:
    """Stage `run`'s video.mp4, preview.png (and decoded.safetensors) in `folder` (its subfolder
    `under`) and report the decode; the report's `failure()` is set if the mp4 breaks the contract."""
    from h3core.reports.schema import TensorChecksum
    from h3core.runtime.device import device_name, peak_memory_kind

    started = time.perf_counter()
    clip, g, kind = run.clip, run.clip.geometry, _device(run.device).type

    def place(name: str) -> str:
        return str(Path(under) / name) if under else name

    video = folder.write(place(VIDEO_FILE), clip.mp4)
    preview = folder.write(place(PREVIEW_FILE), clip.preview)
    saved = folder.write(place(DECODED_FILE), clip.decoded) if clip.decoded is not None else None
    seconds = clip.seconds
    write_s = seconds["write"] + time.perf_counter() - started
    estimate = estimate_decode_memory(
        g.width, g.height, g.frames, video=VideoDecoderSize.of(run.video_vae.config), audio=AudioDecoderSize.of(run.audio_vae.config), ranks=len(run.memory),
        device=kind,
    )
    return DecodeReport(
        geometry=g, latents={k: TensorChecksum.of(latents[k]) for k in ("video", "audio")}, decoded=clip.checksums,
        video_vae=run.video_vae, audio_vae=run.audio_vae, weights="synthetic" if clip.synthetic else "checkpoint",
        device=run.device, device_name=device_name(kind), ranks=len(run.memory),
        timings=DecodeTimings(
            load_s=run.load_s, video_s=seconds["video"], audio_s=seconds["audio"], mux_s=seconds["mux"], write_s=write_s,
            total_s=run.load_s + run.decode_s + seconds["mux"] + write_s,
        ),
        peak_memory_bytes=max(m.peak for m in run.memory), peak_memory_kind=peak_memory_kind(kind),
        rank_memory=[RankDecodeMemory(peak_bytes=m.peak, start_bytes=m.start) for m in run.memory], memory_estimate=estimate,
        units_per_rank=run.units,
        probe=clip.probe, problems=clip.probe.problems(g),
        files=DecodeFiles(video=str(video), preview=str(preview), decoded=str(saved) if saved else None),
    )


def _device(device: "torch.device | str") -> "torch.device":
    import torch

    from h3core.runtime.device import resolve_device

    if isinstance(device, torch.device):
        return device
    kind = resolve_device(device)
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def _decoded_bytes(decoded: Decoded) -> bytes:
    from safetensors.torch import save

    g = decoded.geometry
    metadata = {"fps": str(FPS), "sample_rate": str(SAMPLE_RATE), "frames": str(g.frames), "muxed_samples": str(g.muxed_samples)}
    return save({"video": decoded.video.contiguous(), "audio": decoded.audio.contiguous()}, metadata=metadata)


def output_bytes(geometry: LatentGeometry, save_decoded: bool) -> int:
    """What a decode writes, for the free-space check: an mp4 bound (one byte per pixel per frame
    and the audio's bit rate) and, when saved, the decoded float32 tensors."""
    g = geometry
    mp4 = g.frames * g.width * g.height + int(g.duration_s * 16_000)
    decoded = 4 * (3 * g.frames * g.width * g.height + 2 * g.decoded_samples) if save_decoded else 0
    return mp4 + decoded


def decode_to_folder(
    latents: Mapping[str, "torch.Tensor"], folder: "OutputFolder", *, vaes: Mapping[Role, VaeChoice] | None = None,
    device: "torch.device | str" = "auto", synthetic_label: bool = False, save_decoded: bool = False, under: str = "",
    title: str = "h3", on_phase: Phase = no_phase,
) -> DecodeReport:
    """Load both VAEs, decode `latents` ({'video': [24, T, H/16, W/16], 'audio': [2, 32, T_a]}, the
    transformer's normalized latents), stage video.mp4 + preview.png (+ decoded.safetensors) in
    `folder`, release the VAEs, and return the report. `vaes`: from `choose_vaes` (None: the
    variables, else the synthetic VAEs). `synthetic_label`: the latents came from synthetic weights."""
    check_latents(latents, "the latents")  # before any VAE loads
    decoders = Decoders.load(vaes, device, on_phase)
    try:
        return decoders.to_folder(latents, folder, synthetic_label=synthetic_label, save_decoded=save_decoded, under=under, title=title, on_phase=on_phase)
    finally:
        decoders.release()
