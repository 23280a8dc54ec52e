"""Which VAE files a decode uses: the flag, else its variable, else beside the transformer, else
the embedded synthetic VAE (where the caller allows it).

Beside the transformer: a folder-layout checkpoint (the diffusers repository, or MiniMax's
`FL2VA/`) keeps its VAEs next to `transformer/`: `vae/` (diffusers) or `video_vae/` (MiniMax)
and `audio_vae/`. `H3_MODEL_PATH` / `--model` may name the `transformer/` folder, the folder
holding it, or a file inside `transformer/`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from h3core import settings
from h3core.decode.vae_files import FLAGS, Role
from h3core.errors import ConfigError

BESIDE: dict[Role, tuple[str, ...]] = {"video": ("vae", "video_vae"), "audio": ("audio_vae",)}
VARIABLES: dict[Role, str] = {"video": settings.VIDEO_VAE_PATH, "audio": settings.AUDIO_VAE_PATH}
COMFY_FILES: dict[Role, str] = {"video": "minimax_h3_video_vae_fp16.safetensors", "audio": "minimax_h3_audio_vae_fp32.safetensors"}
SYNTHETIC = "the embedded synthetic VAE"


@dataclass(frozen=True)
class VaeChoice:
    """One VAE to load: `path` None means the embedded synthetic VAE."""

    role: Role
    path: Path | None
    found_by: str

    @property
    def source(self) -> str:
        """How error lines name where the path came from."""
        return self.found_by if self.found_by.startswith(("--", "H3_")) else f"the {self.role} VAE {self.found_by}"


def checkpoint_root(model_path: Path | None) -> Path | None:
    """The folder that holds `transformer/` for a folder-layout checkpoint, else None."""
    if model_path is None:
        return None
    path = Path(model_path)
    if path.is_file():
        path = path.parent
    if path.name == "transformer" and path.is_dir():
        return path.parent
    if (path / "transformer").is_dir():
        return path
    return None


def beside_transformer(model_path: Path | None, role: Role) -> Path | None:
    """`vae/` / `video_vae/` or `audio_vae/` next to the checkpoint's `transformer/`, if there."""
    root = checkpoint_root(model_path)
    if root is None:
        return None
    return next((root / name for name in BESIDE[role] if (root / name).is_dir()), None)


def choose_vae(role: Role, flag: Path | None, model_path: Path | None, *, allow_synthetic: bool = True) -> VaeChoice:
    """The `role` VAE: flag > variable > beside the transformer > synthetic (if allowed)."""
    if flag is not None:
        return VaeChoice(role, Path(flag), FLAGS[role])
    path = settings.video_vae_path(None) if role == "video" else settings.audio_vae_path(None)
    if path is not None:
        return VaeChoice(role, path, VARIABLES[role])
    found = beside_transformer(model_path, role)
    if found is not None:
        return VaeChoice(role, found, f"beside the transformer ({found})")
    if not allow_synthetic:
        raise ConfigError(
            f"no {role} VAE for the checkpoint {model_path}: pass {FLAGS[role]} (e.g. {COMFY_FILES[role]}) or set "
            f"{VARIABLES[role]}, or decode later with `h3 decode` (--no-decode)"
        )
    return VaeChoice(role, None, SYNTHETIC)


def choose_vaes(video: Path | None, audio: Path | None, model_path: Path | None = None, *, allow_synthetic: bool = True) -> dict[Role, VaeChoice]:
    """Both VAEs (see `choose_vae`)."""
    return {
        "video": choose_vae("video", video, model_path, allow_synthetic=allow_synthetic),
        "audio": choose_vae("audio", audio, model_path, allow_synthetic=allow_synthetic),
    }
