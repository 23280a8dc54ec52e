"""H3's audio VAE (DAC encoder, BigVGAN decoder) in diffusers' `AutoencoderKLMiniMaxH3Audio`.

Three spellings of the same module tree:

- `weight-norm`: diffusers' (`torch.nn.utils.weight_norm`: `X.weight_g` / `X.weight_v`);
- `parametrized`: MiniMax's own source (`FL2VA/audio_vae/dac_audio_vae.py`, `dac_bigvgan.py` use
  `torch.nn.utils.parametrizations.weight_norm`: `X.parametrizations.weight.original0` = g,
  `original1` = v). diffusers' docstring says its names are the original checkpoint's "including
  weight_g / weight_v"; the MiniMax source says otherwise, so h3 reads both;
- `folded`: the Comfy file (`minimax_h3_audio_vae_fp32.safetensors`, ComfyUI
  `comfy/ldm/minimax/audio_vae.py`): plain `X.weight` = g * v / ||v||, the norm over every dim but 0.

h3 runs the folded form in every case: g and v are loaded into diffusers' model as diffusers loads
them and then folded with `torch.nn.utils.remove_weight_norm`, which computes
`torch._weight_norm(v, g, 0)`, the very tensor diffusers' forward hook computes on every call; a
folded file is loaded into the same model after folding. Either way the convolutions see the
weights diffusers' own model would.

The Kaiser-sinc `filter` buffers of the anti-aliased activations are not taken from any file: the
class computes them (diffusers' `kaiser_sinc_filter1d`, cutoff 0.5/2, half-width 0.6/2, 12 taps),
because one ComfyUI version applied `exp()` to the stored upsample filter and another did not
(MINIMAX_H3.md §6.2). `pre_block.attn.zero_k_bias` is zeros by definition.

The structure (DAC strides with product 800, 8 attention heads, BigVGAN rates 5,5,2,2,2,2,2 with
kernels 9,9,4,4,4,4,4, AMP kernels 3,7,11 at dilations 1,3,5, 32 kHz) is fixed; widths are read from
the shapes.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Mapping

from h3core.checkpoints import numbered
from h3core.errors import CheckpointError

if TYPE_CHECKING:
    import torch

STRUCTURE: dict[str, object] = {
    "num_attention_heads": 8,
    "decoder_rates": (5, 5, 2, 2, 2, 2, 2),
    "decoder_kernel_sizes": (9, 9, 4, 4, 4, 4, 4),
    "resblock_kernel_sizes": (3, 7, 11),
    "resblock_dilation_sizes": ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
    "sampling_rate": 32000,
}
"""What the shapes cannot say (MiniMax `FL2VA/audio_vae/metadata.json`; diffusers' defaults)."""
HOP = 800

PUBLISHED_LATENTS_MEAN = (
    -0.020211687488382354, 0.3876466479950502, -0.04398279799186767, -0.28591514936373,
    0.08179686214561671, -0.35782641352446604, 0.040623809960919084, -0.01552534501956604,
    -0.223362481667332, 0.1821006842509091, 0.2941778783780663, -0.07901167601970885,
    -0.056815072777201, -0.3699028221860095, -0.31616315591624855, 0.5905951377425391,
    -0.052139568068853864, 0.013673160263486295, -0.03691647864630577, 0.09732660653298163,
    -0.3394662328788498, -0.30685677538541667, -0.24504598907458763, -0.034698524462007344,
    0.02868032184767538, -0.21217779266454084, -0.1678263169941987, 0.3221287889040614,
    -0.1223055851554907, 0.4356604928128464, -0.0502599202236253, 0.3979258376211797,
)  # fmt: skip
PUBLISHED_LATENTS_STD = (
    1.6895524230479284, 2.76263727217653, 1.7945344281264435, 1.6801681847309828,
    1.6390226546605453, 2.7788298348882177, 1.7659090095747236, 1.6199757612137327,
    2.6336525640336896, 1.8539356672817833, 2.5056497896915633, 1.811019237886178,
    1.9579657790720237, 1.6685498243529284, 1.4922469314453364, 3.298670198067373,
    1.9491804496832168, 1.8720003270431442, 1.8334080103291832, 1.6488070416529093,
    1.6176957696319716, 1.9131449234774398, 1.5695245398428617, 1.6943659940415912,
    1.8318420762504692, 1.5540637421583379, 1.9344930328968526, 1.599198216109855,
    1.718045989838149, 1.6307219190837705, 1.8661226051202384, 1.5613768203168363,
)  # fmt: skip
"""MiniMax's published audio latent statistics (`FL2VA/audio_vae/config.json`)."""

BUFFERS = re.compile(r"(\.filter|\.zero_k_bias)$")
"""Buffers the class computes itself (never read from a file)."""
DROPPED = ("latents_mean", "latents_std")
DECODER_ONLY_SKIPS = ("encoder.", "pre_block.", "mean_proj.", "logs_proj.")
"""What decoding never touches (diffusers' `decode` uses `dec_in_proj` and `decoder` only)."""


PARAMETRIZED = re.compile(r"\.parametrizations\.weight\.original([01])$")


def weight_of(shapes: Mapping[str, tuple[int, ...]], module: str) -> tuple[int, ...] | None:
    """The shape of a convolution's weight in any spelling (`weight`, `weight_v`, `parametrizations.weight.original1`)."""
    return shapes.get(f"{module}.weight") or shapes.get(f"{module}.weight_v") or shapes.get(f"{module}.parametrizations.weight.original1")


def weight_norm_names(tensors: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """`X.parametrizations.weight.original0/1` -> `X.weight_g` / `X.weight_v` (diffusers' spelling)."""
    return {PARAMETRIZED.sub(lambda m: ".weight_g" if m.group(1) == "0" else ".weight_v", name): t for name, t in tensors.items()}


_DOWNSAMPLER = re.compile(r"^encoder\.block\.[^.]*\.block\.4\.")


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], where: str) -> dict[str, object]:
    """diffusers' `AutoencoderKLMiniMaxH3Audio` config (less the latent statistics) from a file's
    shapes, in either weight form; a structure that is not H3's is a CheckpointError."""

    def need(module: str) -> tuple[int, ...]:
        """A convolution's weight shape: 3-D with no empty dimension (what the config is read from)."""
        shape = weight_of(shapes, module)
        if shape is None:
            raise CheckpointError(f"{where} has no weight for {module}; it is not a whole H3 audio VAE (download it again)")
        if len(shape) != 3 or not all(shape):
            raise CheckpointError(f"{where}: the weight of {module} has shape {list(shape)}, not a 1-D convolution's; not an H3 audio VAE")
        return shape

    try:  # (no number in a name is trusted: h3core.checkpoints.numbered)
        blocks = sorted({numbered.index_of(name, "encoder.block.") for name in shapes if _DOWNSAMPLER.match(name)})
    except numbered.BadIndex as err:
        raise CheckpointError(f"{where}: {err}; not an H3 audio VAE") from None
    if blocks != list(range(1, len(blocks) + 1)):
        raise CheckpointError(f"{where}: the encoder's downsampling blocks are {blocks[:5]}, not 1..n; not an H3 audio VAE")
    rates = tuple(need(f"encoder.block.{i}.block.4")[2] // 2 for i in blocks)
    if math.prod(rates) != HOP:
        raise CheckpointError(f"{where}: the encoder's strides {list(rates)} do not make 800 samples per latent; not an H3 audio VAE")
    ups = tuple(need(f"decoder.ups.{i}.0")[2] for i in range(len(STRUCTURE["decoder_kernel_sizes"])))  # type: ignore[arg-type]
    amp = tuple(need(f"decoder.resblocks.{i}.convs1.0")[2] for i in range(3))
    if ups != STRUCTURE["decoder_kernel_sizes"] or amp != STRUCTURE["resblock_kernel_sizes"] or weight_of(shapes, "decoder.ups.7.0"):
        raise CheckpointError(f"{where}: the BigVGAN decoder (upsampler kernels {list(ups)}, AMP kernels {list(amp)}) is not H3's; not an H3 audio VAE")
    latent = need("mean_proj")[0]
    return {
        **STRUCTURE,
        "encoder_dim": need("encoder.block.0")[0],
        "encoder_rates": rates,
        "latent_dim": need("dec_in_proj")[0],
        "latent_channels": latent,
        "decoder_dim": need("decoder.conv_pre")[0],
    }


def check_structure(config: Mapping[str, object], where: str) -> None:
    """A diffusers config.json describes H3's audio geometry (32 channels, 800 samples per latent, 32 kHz)."""
    rates = tuple(config.get("encoder_rates", (2, 4, 4, 5, 5)))  # type: ignore[arg-type]
    if config.get("latent_channels", 32) != 32 or config.get("sampling_rate", 32000) != 32000 or math.prod(rates) != HOP:
        raise CheckpointError(
            f"{where}: latent_channels={config.get('latent_channels')}, sampling_rate={config.get('sampling_rate')}, "
            f"encoder_rates={list(rates)} is not H3's audio VAE (32 channels, 32 kHz, 800 samples per latent)"
        )


def fold_weight_norm(model: "torch.nn.Module") -> int:
    """Replace every `weight_g`/`weight_v` pair by its folded `weight` (`remove_weight_norm`); returns how many."""
    import torch

    normed = [m for m in model.modules() if hasattr(m, "weight_g") and hasattr(m, "weight_v")]
    for module in normed:
        torch.nn.utils.remove_weight_norm(module)
    return len(normed)


def fold_tensors(tensors: Mapping[str, "torch.Tensor"]) -> dict[str, "torch.Tensor"]:
    """A weight-norm state dict -> the folded one (the Comfy file's form): w = g * v / ||v|| per dim 0."""
    import torch

    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_g"):
            continue
        if name.endswith(".weight_v"):
            base = name[: -len("_v")]
            out[base] = torch._weight_norm(tensor, tensors[f"{base}_g"], 0)
        else:
            out[name] = tensor
    return out
