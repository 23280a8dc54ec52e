"""Load an H3 VAE, whatever its container and key layout, into diffusers' own class.

One path for every file: the config (the folder's `config.json`, or the widths read from the shapes),
the latent statistics, the model built by diffusers' class without initializing a weight (the video
VAE on the meta device, its computed buffers then made by diffusers' own code; `build_model`), the
tensors read once each as float32 onto the device, renamed from the file's layout, and put in place
(`assign=True`) with every name accounted for (a missing or an unexpected tensor is a CheckpointError).

`decoder_only` (the default) leaves out what decoding never runs: the video VAE's encoder and
`quant_conv` (180 M parameters, 0.7 GB in fp32), the audio VAE's encoder, `pre_block` and posterior
heads (87 M). `encoder_only` (the video VAE, for keyframes: `h3core.keyframes.latents`) is the
other half: the encoder and `quant_conv` alone, without the 2.4 B-parameter decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from h3core.decode import audio_vae, video_vae
from h3core.decode.report import VaeInfo
from h3core.decode.vae_files import VaeFiles, read_tensors
from h3core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

LATENT_CHANNELS = {"video": 24, "audio": 32}
_SHOWN = 4  # names listed in an error line


@dataclass
class LoadedVae:
    """A diffusers VAE in eval mode, float32, on its device, with what was loaded."""

    model: "torch.nn.Module"
    info: VaeInfo

    @property
    def device(self) -> "torch.device":
        return next(self.model.parameters()).device


def load_vae(files: VaeFiles, device: "torch.device | str" = "cpu", *, decoder_only: bool = True, encoder_only: bool = False) -> LoadedVae:
    """The VAE `files` describe, as diffusers' `AutoencoderKLMiniMaxH3` / `AutoencoderKLMiniMaxH3Audio`
    (`encoder_only`: the video VAE's encoder and `quant_conv` alone, whatever `decoder_only` says)."""
    where = f"{files.path}"
    config = vae_config(files, where)
    stats_from = _add_latent_stats(config, files, where)
    if encoder_only and files.role != "video":
        raise ValueError("only the video VAE loads as an encoder alone (keyframes)")
    if files.role == "video":
        model = _video_model(files, config, device, decoder_only and not encoder_only, where, encoder_only=encoder_only)
    else:
        model = _audio_model(files, config, device, decoder_only, where)
    model.to(device).eval().requires_grad_(False)
    info = VaeInfo(
        role=files.role, path=str(files.path), container=files.container, key_layout=files.key_layout,
        synthetic=files.synthetic, file_dtype=files.file_dtype(), latents_stats_from=stats_from,
        parameters=sum(p.numel() for p in model.parameters()), decoder_only=decoder_only,
        config={k: v for k, v in config.items() if k not in ("latents_mean", "latents_std")},
    )
    return LoadedVae(model=model, info=info)


# --- config ------------------------------------------------------------------------------------------


def vae_config(files: VaeFiles, where: str) -> dict[str, object]:
    """diffusers' config of the VAE `files` describe (its config.json, else from the tensor shapes), without the latent statistics."""
    if files.container == "diffusers folder":
        config = {k: v for k, v in files.config.items() if not k.startswith("_")}
        (video_vae if files.role == "video" else audio_vae).check_structure(config, where)
        return config
    if files.role == "video":
        return video_vae.config_from_shapes(files.shapes, files.key_layout, where)
    return audio_vae.config_from_shapes(files.shapes, where)


def _add_latent_stats(config: dict[str, object], files: VaeFiles, where: str) -> str:
    """Put the per-channel latent mean and std into `config` (where diffusers' pipeline reads them);
    returns where they came from: config.json, the file's tensors, or MiniMax's published values."""
    channels = LATENT_CHANNELS[files.role]
    module = video_vae if files.role == "video" else audio_vae
    if isinstance(files.config.get("latents_mean"), list) and isinstance(files.config.get("latents_std"), list):
        mean, std, source = files.config["latents_mean"], files.config["latents_std"], "config.json"
    elif "latents_mean" in files.shapes and "latents_std" in files.shapes:
        stats = read_tensors(files, skip=lambda name: name not in ("latents_mean", "latents_std"))
        mean, std, source = stats["latents_mean"].tolist(), stats["latents_std"].tolist(), "the file's latents_mean/latents_std"
    else:
        mean, std = list(module.PUBLISHED_LATENTS_MEAN), list(module.PUBLISHED_LATENTS_STD)
        source = "MiniMax's published values (the file has none)"
    if len(mean) != channels or len(std) != channels or min(std) <= 0:
        raise CheckpointError(f"{where}: latents_mean/latents_std have {len(mean)}/{len(std)} values; the {files.role} VAE needs {channels} each, std > 0")
    config["latents_mean"], config["latents_std"] = [float(x) for x in mean], [float(x) for x in std]
    return source


# --- models ------------------------------------------------------------------------------------------


def build_model(role: str, config: Mapping[str, object]) -> "torch.nn.Module":
    """diffusers' class for `role`, built from `config` without initializing a weight (the weights
    come from a file next, `load_state_dict(assign=True)`).

    The video VAE is built on the meta device (its decoder is 2.4 B parameters: nothing allocated),
    the buffers the class computes then made on the CPU by diffusers' own code
    (`video_vae.compute_buffers`). The audio VAE is built on the CPU under diffusers'
    `no_init_weights`: its constructor runs weight norm and ~250 Kaiser-sinc filters, whose meta
    kernels are Python decompositions (measured: 0.59 s on meta against 0.10 s on the CPU for the
    synthetic VAE, fresh processes, median of 3), and its weights are small."""
    import contextlib
    import inspect
    import warnings

    import torch
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from diffusers.models.modeling_utils import no_init_weights

    cls = AutoencoderKLMiniMaxH3 if role == "video" else AutoencoderKLMiniMaxH3Audio
    known = inspect.signature(cls.__init__).parameters
    arguments = {k: v for k, v in config.items() if k in known}  # a config.json may carry keys of other diffusers versions
    empty = torch.device("meta") if role == "video" else contextlib.nullcontext()
    with empty, no_init_weights(), warnings.catch_warnings():
        # diffusers' audio VAE uses torch.nn.utils.weight_norm, which torch marks deprecated; h3 folds it anyway
        warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)
        model = cls(**arguments)
    if role == "video":
        video_vae.compute_buffers(model)
    return model


def _video_model(files: VaeFiles, config: dict, device, decoder_only: bool, where: str, encoder_only: bool = False) -> "torch.nn.Module":
    model = build_model("video", config)
    if decoder_only:
        model.encoder = None
        model.quant_conv = None
    if encoder_only:
        model.decoder = None
        model.post_quant_conv = None
    skips = video_vae.DECODER_ONLY_SKIPS if decoder_only else video_vae.ENCODER_ONLY_SKIPS if encoder_only else ()
    tensors = read_tensors(files, skip=lambda name: name.startswith(skips) or name in video_vae.DROPPED, device=device)
    if files.key_layout == "original":
        tensors = video_vae.original_to_diffusers(tensors, int(config["decoder_num_attention_heads"]))
    _load_exactly(model, tensors, where, computed=())
    return model


def _audio_model(files: VaeFiles, config: dict, device, decoder_only: bool, where: str) -> "torch.nn.Module":
    model = build_model("audio", config)
    if decoder_only:
        for name in ("encoder", "pre_block", "mean_proj", "logs_proj"):
            setattr(model, name, None)
    skips = audio_vae.DECODER_ONLY_SKIPS if decoder_only else ()
    tensors = read_tensors(
        files, skip=lambda name: name.startswith(skips) or name in audio_vae.DROPPED or bool(audio_vae.BUFFERS.search(name)), device=device
    )
    if files.key_layout == "parametrized":
        tensors = audio_vae.weight_norm_names(tensors)
    folded = files.key_layout == "folded"
    if folded:
        audio_vae.fold_weight_norm(model)  # the file holds the folded weights: load into the folded model
    _load_exactly(model, tensors, where, computed=(audio_vae.BUFFERS,))
    if not folded:
        audio_vae.fold_weight_norm(model)  # g, v loaded as diffusers loads them: fold into what its hook computes
    return model


def _load_exactly(model: "torch.nn.Module", tensors: Mapping[str, "torch.Tensor"], where: str, computed: Sequence) -> None:
    """`load_state_dict(assign=True)` where every model tensor but the `computed` buffers comes from
    the file and every file tensor has a place; otherwise a CheckpointError naming them."""
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    missing = sorted(k for k in expected if k not in tensors and not any(p.search(k) for p in computed))
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} tensors ({', '.join(missing[:_SHOWN])}{', ...' if len(missing) > _SHOWN else ''})")
        if unexpected:
            parts.append(f"has {len(unexpected)} tensors H3's VAE does not ({', '.join(unexpected[:_SHOWN])}{', ...' if len(unexpected) > _SHOWN else ''})")
        raise CheckpointError(f"{where} {' and '.join(parts)}; it is not a whole H3 VAE of this layout (download it again)")
    wrong = [(k, tuple(t.shape), expected[k]) for k, t in tensors.items() if tuple(t.shape) != expected[k]]
    if wrong:
        name, got, want = wrong[0]
        raise CheckpointError(f"{where}: tensor {name} is {list(got)}, the model built from its config needs {list(want)}; the file and its config disagree")
    model.load_state_dict(dict(tensors), strict=False, assign=True)
    _check_materialized(model)


def _check_materialized(model: "torch.nn.Module") -> None:
    """Every tensor of `model` has data: one left on the meta device would be a buffer diffusers' class
    computes that `compute_buffers` does not know (a new diffusers version): fail here, not in the decode."""
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise RuntimeError(f"the VAE's {', '.join(empty[:_SHOWN])} were neither in the file nor computed; diffusers' class has changed (h3 pins diffusers==0.42.1)")
