"""The synthetic H3 checkpoint: deterministic weights in the real format, calibrated, cached on disk.

With no `--model`, h3 runs this checkpoint through the same loader as a real one (every report says
`weights: synthetic`). It is deterministic from (config, seed): every tensor is drawn from its own
generator seeded by (seed, tensor name), so the file does not depend on write order. Like a
ModelOpt export it carries an `input_scale` for every NVFP4 linear, calibrated as ModelOpt does:
the amax of the linear's input over a calibration pass (the synthetic text encoder on a fixed
prompt, seeded noise at the preset's size with one latent frame, 4 Euler steps), rounded up to
3 significant bits (so that the last-bit differences of another machine's GEMMs do not change
the file), divided by 6 * 448. It is cached on disk (`H3_CACHE_DIR`): a second run with the same
config and seed reads it instead of rebuilding it.
"""

from __future__ import annotations

import errno
import hashlib
import math
import zlib
from pathlib import Path

import torch

from h3core import settings
from h3core.errors import CheckpointError
from h3core.files.paths import free_bytes, os_error_reason
from h3core.files.safetensors import SafetensorsReader, write_safetensors
from h3core.model.checkpoint import FORMAT_VERSION, SYNTHETIC, TensorSpec, metadata, nvfp4_prefixes, schema, stored_bytes
from h3core.model.config import ModelConfig
from h3core.model.dit import H3Model, PackedSequence, patchify_audio, patchify_video, rope_table, token_positions
from h3core.model.sampler import FlowMatchEuler, initial_noise
from h3core.model.sequence import SegmentKind
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import GLOBAL_SCALE_DIVISOR, quantize
from h3core.nvfp4.io import linear_tensors
from h3core.nvfp4.linear import NVFP4Linear
from h3core.reports.units import format_bytes
from h3core.text import load_text_encoder, release_text_encoder

GENERATOR_VERSION = "2"
"""Bump when the synthetic weights change, to invalidate caches (2: input_scale)."""


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _synthetic_dense(spec: TensorSpec, seed: int) -> torch.Tensor:
    """Deterministic values for a dense tensor, scaled so activations stay O(1)."""
    g = _generator(seed, spec.name)
    if spec.name.endswith("norm_q.weight") or spec.name.endswith("norm_k.weight"):
        values = 1.0 + 0.1 * torch.randn(spec.shape, generator=g)
    elif spec.name.endswith("modulation"):
        values = 0.1 * torch.randn(spec.shape, generator=g)  # non-zero gates: every block contributes
    elif spec.name.endswith(".bias"):
        values = 0.02 * torch.randn(spec.shape, generator=g)
    elif len(spec.shape) == 2 and spec.name.endswith(".weight"):
        values = torch.randn(spec.shape, generator=g) / spec.shape[1] ** 0.5
    else:
        values = torch.randn(spec.shape, generator=g)
    return values.to(torch.bfloat16)


def synthetic_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """All tensors of a synthetic checkpoint: NVFP4-quantized linears with calibrated input scales,
    bf16 everything else."""
    specs = schema(config)
    by_name = {s.name: s for s in specs}
    prefixes = nvfp4_prefixes(H3Model(config))
    tensors: dict[str, torch.Tensor] = {}
    for prefix in prefixes:
        out_features, packed_cols = by_name[f"{prefix}.weight"].shape
        in_features = layout.unpacked_width(packed_cols)
        weight = torch.randn(out_features, in_features, generator=_generator(seed, f"{prefix}.weight")) / in_features**0.5
        bias_spec = by_name.get(f"{prefix}.bias")
        bias = _synthetic_dense(bias_spec, seed) if bias_spec else None
        tensors.update(linear_tensors(prefix, NVFP4Linear(quantize(weight), bias=bias)))
    for spec in specs:
        if spec.name not in tensors:
            tensors[spec.name] = _synthetic_dense(spec, seed)
    tensors.update(calibrated_input_scales(config, tensors))
    return tensors


# --- calibration (ModelOpt's static activation scales) ------------------------------------------------

CALIBRATION_PROMPT = "a red fox running through fresh snow at dawn, wind and crunching footsteps"
CALIBRATION_STEPS = 4
CALIBRATION_SEED = 0


def calibrated_input_scales(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`{<linear>.input_scale: amax / (6 * 448)}` for every NVFP4 linear, from a calibration pass.

    The model of `tensors` runs, in float32 on the CPU, the sampler's first `CALIBRATION_STEPS`
    Euler steps on the synthetic text encoder's hidden states of `CALIBRATION_PROMPT` and seeded
    noise at the preset's width and height with one latent frame; each linear's input amax over
    all of them is rounded up to 3 significant bits (see the module docstring).
    """
    model = H3Model(config)
    model.load_state_dict({name: t.float() if t.dtype == torch.bfloat16 else t for name, t in tensors.items()}, strict=False, assign=True)
    amax: dict[str, float] = {}

    def recorder(prefix: str):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, args: tuple) -> None:
            x = args[0]
            if x.numel():
                amax[prefix] = max(amax.get(prefix, 0.0), float(x.detach().abs().amax()))

        return hook

    handles = [model.get_submodule(p).register_forward_pre_hook(recorder(p)) for p in nvfp4_prefixes(model)]
    emulating, NVFP4Linear.emulate_fp4 = NVFP4Linear.emulate_fp4, False  # unquantized activations, whatever H3_EMULATE_FP4 says
    try:
        with torch.inference_mode():
            _calibration_pass(config, model.eval())
    finally:
        NVFP4Linear.emulate_fp4 = emulating
        for handle in handles:
            handle.remove()
    return {f"{p}.input_scale": _input_scale(amax.get(p, 0.0)) for p in nvfp4_prefixes(model)}


def _input_scale(amax: float) -> torch.Tensor:
    rounded = _round_up_3_bits(amax)
    return torch.tensor(rounded / GLOBAL_SCALE_DIVISOR if rounded > 0 else 1.0, dtype=torch.float32)


def _calibration_pass(config: ModelConfig, model: H3Model) -> None:
    encoder = load_text_encoder(None, hidden_size=config.text_dim, seed=0)
    text = encoder.encode(CALIBRATION_PROMPT, config.max_text_tokens).float()  # [L, text_dim]
    release_text_encoder(encoder)
    frames = 1
    segments = config.segments(config.width, config.height, frames, text.shape[0])
    grid = config.video_grid(config.width, config.height, frames)
    rope = rope_table(config, token_positions(segments, grid))
    shapes = {"video": config.video_latent_shape(config.width, config.height, frames), "audio": config.audio_latent_shape(frames)}
    noise = initial_noise(CALIBRATION_SEED, shapes)
    state = {SegmentKind.VIDEO: patchify_video(noise["video"], config.video_patch), SegmentKind.AUDIO: patchify_audio(noise["audio"], config.audio_patch)}
    sampler = FlowMatchEuler(config.shift)
    for i, sigma in enumerate(sampler.set_timesteps(CALIBRATION_STEPS)):
        velocity = model(PackedSequence(segments=segments, features={SegmentKind.TEXT: text, **state}, rope=rope), sigma)
        state = {kind: sampler.step(velocity[kind], i, state[kind]) for kind in state}


def _round_up_3_bits(value: float) -> float:
    """The smallest number with 3 significant bits that is >= `value` (0 stays 0)."""
    if value <= 0:
        return 0.0
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(math.ceil(mantissa * 8) / 8, exponent)


def synthetic_checkpoint(config: ModelConfig, seed: int = 0, directory: Path | None = None) -> tuple[Path, bool]:
    """Path of the cached synthetic checkpoint for (config, seed), writing it first if needed.

    Returns (path, built): `built` is False when the cached file was reused. A cached file that
    does not read back as that checkpoint (truncated, corrupt, another config) is derived data:
    it is rebuilt, never reported as a download to repeat. A cache folder that cannot take the
    file (read-only, full) is one line naming H3_CACHE_DIR, checked before the tensors are made.
    """
    key = hashlib.sha256(f"{config.model_dump_json()}|{seed}|{FORMAT_VERSION}|{GENERATOR_VERSION}".encode()).hexdigest()[:12]
    folder = directory or settings.cache_dir()
    path = folder / f"synthetic-{config.name}-{key}.safetensors"
    if path.exists() and _is_cached_synthetic(path, config):
        return path, False
    expected = sum(stored_bytes(s) for s in schema(config))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if free_bytes(folder) < expected:
            raise OSError(errno.ENOSPC, "not enough free space")
        write_safetensors(path, synthetic_tensors(config, seed), metadata(config, SYNTHETIC, seed=str(seed)))
    except OSError as err:
        raise CheckpointError(
            f"cannot write the synthetic checkpoint ({format_bytes(expected)}) to the cache folder {folder}: "
            f"{os_error_reason(err)}; set H3_CACHE_DIR to a writable folder with room for it"
        ) from None
    return path, True


def _is_cached_synthetic(path: Path, config: ModelConfig) -> bool:
    """The cached file opens as a safetensors file (header and size) and holds `config`'s synthetic weights."""
    try:
        with SafetensorsReader([path]) as reader:
            meta = reader.metadata
    except CheckpointError:
        return False
    return meta.get("weights") == SYNTHETIC and meta.get("config") == config.model_dump_json()
