"""A VAE checkpoint on disk: which files, which VAE (video or audio), which key layout -- settled
from the safetensors headers and `config.json`, never from a file's name.

Accepted containers:

- a single `.safetensors` file: the Comfy repacks (`minimax_h3_video_vae_fp16.safetensors`,
  `minimax_h3_audio_vae_fp32.safetensors`, in the ComfyUI module tree's names, the audio VAE's
  weight norm folded) or a diffusers weights file;
- a diffusers folder (`vae/`, `audio_vae/`): `config.json` with `_class_name`
  `AutoencoderKLMiniMaxH3` / `AutoencoderKLMiniMaxH3Audio` and `diffusion_pytorch_model*.safetensors`;
- a MiniMax folder (the official repository's `video_vae/` or `audio_vae/`): `config.json` with
  `_class_name` `MiniMaxH3VideoVAE` / `MiniMaxH3AudioVAE` naming its weights file
  (`source_path` / `source_safetensors_path`), in the original module names.

Key layouts (what the tensor names say):

- video `original`: `decoder.x_embedder.*`, `decoder.transformer_blocks.K.attn.to_qkv.*`, ... (the
  MiniMax module tree, which ComfyUI keeps); video `diffusers`: `decoder.proj_in.*`, `attn.to_q.*`;
- audio `folded`: plain `*.weight` for the weight-normed convolutions (the Comfy file); audio
  `weight-norm`: `*.weight_g` / `*.weight_v` (diffusers); audio `parametrized`:
  `*.parametrizations.weight.original0/1` (MiniMax's source, `torch.nn.utils.parametrizations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

from h3core.errors import CheckpointError
from h3core.files.paths import inside, path_kind
from h3core.files.text import MAX_CONFIG_BYTES, read_json

if TYPE_CHECKING:
    import torch

    from h3core.files.safetensors import SafetensorsReader

Role = Literal["video", "audio"]
CONFIG_FILE = "config.json"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"

DIFFUSERS_CLASSES: dict[str, Role] = {"AutoencoderKLMiniMaxH3": "video", "AutoencoderKLMiniMaxH3Audio": "audio"}
MINIMAX_CLASSES: dict[str, Role] = {"MiniMaxH3VideoVAE": "video", "MiniMaxH3AudioVAE": "audio"}

# One tensor name that only each key layout has.
KEY_LAYOUTS: dict[tuple[Role, str], str] = {
    ("video", "original"): "decoder.x_embedder.weight",
    ("video", "diffusers"): "decoder.proj_in.weight",
    ("audio", "folded"): "decoder.conv_pre.weight",
    ("audio", "weight-norm"): "decoder.conv_pre.weight_g",
    ("audio", "parametrized"): "decoder.conv_pre.parametrizations.weight.original0",
}
# What a file that is not a VAE may be instead (for the error line).
LOOKALIKES = {
    "token_refiner.blocks.0.attn.qkv_proj.weight": "the H3 transformer (Comfy/original names)",
    "adaln_t_table": "the AdaLN-pruned H3 transformer",
    "transformer_blocks.0.attn.to_q.weight": "a diffusers transformer",
    "model.language_model.embed_tokens.weight": "a Qwen3-VL text encoder",
    "model.embed_tokens.weight": "a Qwen3 text encoder",
}
FLAGS: dict[Role, str] = {"video": "--video-vae", "audio": "--audio-vae"}


@dataclass
class VaeFiles:
    """Where one VAE's weights are and what they are, from the files themselves."""

    role: Role
    path: Path
    """What the user pointed at (file or folder)."""
    container: Literal["single file", "diffusers folder", "MiniMax folder"]
    key_layout: str
    weights: list[Path]
    config: dict = field(default_factory=dict)
    """The folder's config.json (empty for a single file)."""
    metadata: dict[str, str] = field(default_factory=dict)
    """The safetensors `__metadata__` (the synthetic VAEs say `weights: synthetic` there)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def synthetic(self) -> bool:
        return self.metadata.get("weights") == "synthetic"

    def open(self) -> "SafetensorsReader":
        from h3core.files.safetensors import SafetensorsReader

        return SafetensorsReader(self.weights)

    def file_dtype(self) -> str:
        """The float dtypes the weights are stored in ('F16', 'F32', or e.g. 'F16+F32')."""
        return "+".join(sorted({d for d in self.dtypes.values() if d.startswith(("F", "BF"))})) or "none"


def find_vae_files(path: Path, role: Role, source: str) -> VaeFiles:
    """The `role` VAE at `path` (file or folder), checked to be that VAE; `source` says where the
    path came from (a flag, a variable, beside the transformer) for the error lines."""
    path = Path(path)
    if path.is_dir():
        files = _folder(path, role, source)
    elif path.is_file():
        files = VaeFiles(role=role, path=path, container="single file", key_layout="", weights=[path])
    else:
        kind = path_kind(path, follow=True)
        what = "does not exist" if kind == "nothing" else f"is {kind}, not a file or folder"
        raise CheckpointError(f"{source} {path} {what}; point it at the {role} VAE (a .safetensors file or its folder)")
    _read_headers(files, source)
    files.key_layout = _key_layout(files, source)
    return files


def _folder(path: Path, role: Role, source: str) -> VaeFiles:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(
            f"{source} {path} is a folder without {CONFIG_FILE}; give the VAE's .safetensors file, or its diffusers "
            f"folder ({'vae' if role == 'video' else 'audio_vae'}/ with config.json)"
        )
    config = _read_json(config_path)
    name = str(config.get("_class_name", ""))
    named_role = DIFFUSERS_CLASSES.get(name) or MINIMAX_CLASSES.get(name)
    if named_role is None:
        raise CheckpointError(f"{config_path} describes {name or 'no class'!r}, not an H3 VAE; point {source} at the {role} VAE")
    if named_role != role:
        raise CheckpointError(f"{source} {path} is the H3 {named_role} VAE, not the {role} VAE; pass it as {FLAGS[named_role]}")
    if name in DIFFUSERS_CLASSES:
        return VaeFiles(role=role, path=path, container="diffusers folder", key_layout="", weights=_diffusers_weights(path), config=config)
    weights = _source_weights(path, config, config_path)
    if not weights.is_file():
        raise CheckpointError(f"{config_path} names the weights {weights}, which {path_kind(weights, follow=True)}; download the folder again")
    return VaeFiles(role=role, path=path, container="MiniMax folder", key_layout="", weights=[weights], config=config)


def _source_weights(folder: Path, config: dict, config_path: Path) -> Path:
    """The weights a MiniMax folder's config names (`source_path` / `source_safetensors_path`): a file
    in the folder, never outside it (an absolute path or a `..` is one line)."""
    names = [config.get("source_path", "."), config.get("source_safetensors_path", "model.safetensors")]
    for name in names:
        if not isinstance(name, str):
            raise CheckpointError(f"{config_path}: source_path and source_safetensors_path must be file names, got {name!r}; download the folder again")
    weights = inside(folder, str(Path(*names)))
    if weights is None:
        raise CheckpointError(f"{config_path} names the weights {str(Path(*names))!r}, outside its folder; the config is corrupt or hostile: "
                              "download the folder again")
    return weights


def _diffusers_weights(folder: Path) -> list[Path]:
    index = folder / DIFFUSERS_INDEX
    if index.is_file():
        from h3core.files.safetensors import index_shards

        return index_shards(index)
    if (folder / DIFFUSERS_WEIGHTS).is_file():
        return [folder / DIFFUSERS_WEIGHTS]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{folder} holds no {DIFFUSERS_WEIGHTS} (nor any .safetensors); download the folder again")
    return found


def _read_json(path: Path) -> dict:
    return read_json(path, "the VAE's JSON file", MAX_CONFIG_BYTES, "download it again", error=CheckpointError, want=dict)


def _read_headers(files: VaeFiles, source: str) -> None:
    """Every tensor's shape and dtype, and the metadata, from the headers (no weight read)."""
    try:
        reader = files.open()
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None
    with reader:
        files.shapes = {name: reader.shape(name) for name in reader.keys()}
        files.dtypes = {name: reader.dtype_name(name) for name in reader.keys()}
        files.metadata = reader.metadata


def _key_layout(files: VaeFiles, source: str) -> str:
    names = files.shapes
    found = [(role, layout) for (role, layout), marker in KEY_LAYOUTS.items() if marker in names]
    for role, layout in found:
        if role == files.role:
            return layout
    if found:
        other = found[0][0]
        raise CheckpointError(f"{source} {files.path} is the H3 {other} VAE, not the {files.role} VAE; pass it as {FLAGS[other]}")
    what = next((kind for marker, kind in LOOKALIKES.items() if marker in names), None)
    looks = f"it looks like {what}" if what else f"its {len(names)} tensors have none of the names an H3 VAE has"
    raise CheckpointError(f"{source} {files.path} is not an H3 {files.role} VAE ({looks}); point it at the {files.role} VAE")


def read_tensors(
    files: VaeFiles, skip: "Callable[[str], bool]" = lambda name: False, device: "torch.device | str" = "cpu"
) -> dict[str, "torch.Tensor"]:
    """The tensors of `files` whose names `skip` does not reject, each as float32 (integer tensors
    as they are) on `device`, read and moved one at a time (the host holds one tensor at a time):
    moved in the stored dtype, widened there (exact either side: fp16/bf16 -> fp32 loses nothing)."""
    out = {}
    with files.open() as reader:
        for name in reader.keys():
            if skip(name):
                continue
            tensor = reader.get(name).to(device)
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out
