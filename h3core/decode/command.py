"""`h3 decode LATENTS`: saved latents -> video.mp4 (+ preview, report, decoded tensors), on any machine.

The latents file is what `h3 generate` writes (`latents.safetensors`): `video` [24, T, H/16, W/16]
and `audio` [2, 32, T_a], float32, in the transformer's normalized latent space; its
`__metadata__` may say `weights: synthetic` (the transformer that made them), which labels the
preview. Everything a user can get wrong (the file, its keys and shapes, the VAE files, the output
folder) is checked before a VAE loads; nothing is written unless everything is.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from h3core import settings
from h3core.decode.geometry import LatentGeometry, check_latent_dtype, geometry_of
from h3core.decode.report import DecodeRunReport
from h3core.decode.run import Decoders, Phase, no_phase, output_bytes
from h3core.decode.sources import VaeChoice, choose_vaes
from h3core.decode.vae_files import Role, find_vae_files
from h3core.errors import CheckpointError, ConfigError
from h3core.files.paths import path_kind
from h3core.settings import UserRequest

REPORT_FILE = "report.json"


class DecodeJob(UserRequest):
    """What `h3 decode` was asked to do."""

    FLAGS = {"latents": "LATENTS", "output": "--output"}

    latents: Path = Field(description="The latents file (`latents.safetensors` of an `h3 generate` run).")
    video_vae: Path | None = Field(None, description="--video-vae (else H3_VIDEO_VAE_PATH, beside H3_MODEL_PATH, the synthetic VAE).")
    audio_vae: Path | None = Field(None, description="--audio-vae (else H3_AUDIO_VAE_PATH, beside H3_MODEL_PATH, the synthetic VAE).")
    output: Path | None = Field(None, description="New or empty output folder (default outputs/<time>-decode-<4 hex>).")
    save_decoded: bool = Field(False, description="Also write decoded.safetensors (video [3, F, H, W] in [0, 1], audio [2, samples] in [-1, 1]).")
    device: str = Field("auto", description="auto, cpu or cuda.")
    overwrite: bool = Field(False, description="Replace an existing folder of h3 results at --output whole.")


def read_latents(path: Path) -> tuple[dict, dict[str, str], LatentGeometry]:
    """The file's two latents (float32, CPU), its metadata and their geometry, checked."""
    from h3core.files.safetensors import SafetensorsReader

    if not path.is_file():
        kind = path_kind(path, follow=True)
        raise ConfigError(f"LATENTS {path} {'does not exist' if kind == 'nothing' else f'is {kind}, not a file'}; give the latents.safetensors of an h3 generate run")
    try:
        reader = SafetensorsReader([path])
    except CheckpointError:
        raise ConfigError(f"LATENTS {path} is not a safetensors file (or is truncated); give the latents.safetensors of an h3 generate run") from None
    with reader:
        missing = [k for k in ("video", "audio") if k not in reader]
        if missing:
            raise ConfigError(
                f"LATENTS {path} has no {' and no '.join(repr(k) for k in missing)} tensor (it has {', '.join(reader.keys()) or 'none'}); "
                "h3 decode reads 'video' [24, T, H/16, W/16] and 'audio' [2, 32, T_a]"
            )
        for name in ("video", "audio"):  # before anything is read or converted
            check_latent_dtype(name, reader.dtype_name(name), f"LATENTS {path}")
        geometry = geometry_of(reader.shape("video"), reader.shape("audio"), f"LATENTS {path}")
        latents = {k: reader.get(k).float() for k in ("video", "audio")}
        return latents, reader.metadata, geometry


def check_vaes(vaes: dict[Role, VaeChoice]) -> None:
    """Each given VAE file is that VAE, read from its header (before any weight loads)."""
    for role, choice in vaes.items():
        if choice.path is not None:
            find_vae_files(choice.path, role, choice.source)


def decode_latents_file(job: DecodeJob, on_phase: Phase = no_phase) -> DecodeRunReport:
    """Run `h3 decode`: check everything, decode, write the folder whole, return its report."""
    from h3core.reports.outputs import Outputs
    from h3core.reports.schema import Versions, report_json

    from h3core.runtime.device import resolve_device

    resolve_device(job.device)  # `--device cuda` without a GPU is one line before anything is read
    latents, metadata, geometry = read_latents(job.latents)
    vaes = choose_vaes(job.video_vae, job.audio_vae, settings.model_path(None))
    check_vaes(vaes)
    with Outputs() as outputs:
        folder = outputs.folder(job.output, kind="decode", need_bytes=output_bytes(geometry, job.save_decoded), overwrite=job.overwrite)
        decoders = Decoders.load(vaes, job.device, on_phase)
        try:
            decoded = decoders.to_folder(
                latents, folder, synthetic_label=metadata.get("weights") == "synthetic", save_decoded=job.save_decoded,
                title=f"h3 decode {job.latents.name}", where=f"LATENTS {job.latents}", on_phase=on_phase,
            )
        finally:
            decoders.release()
        report = DecodeRunReport(
            latents_file=str(job.latents), latents_metadata=metadata, report=str(folder.path / REPORT_FILE), versions=Versions.collect(), decode=decoded
        )
        folder.write(REPORT_FILE, report_json(report))
        outputs.publish()
    return report
