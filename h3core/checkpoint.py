"""The H3 checkpoint: its contract, the loader, and the synthetic-checkpoint writer.

The contract (docs/checkpoint.md has the table) is the state dict of `H3Model` itself: every
module's tensor names and shapes, NVFP4 linears under ModelOpt names (`<layer>.weight` uint8
`[out, in/2]`, `.weight_scale` fp8 `[out, in/16]`, `.weight_scale_2` fp32 `[]`, `.bias`), dense
tensors in bf16/fp16/fp32. A file carries, in its safetensors metadata, `format` = `h3-nvfp4`,
`format_version`, `config` (the `ModelConfig` as JSON) and `weights` (`synthetic` or a free-form
origin). A file without `config` metadata has its dimensions inferred from its shapes; when both
exist they must agree.

Loading builds the model on the meta device and assigns each tensor read from disk straight into
it (`load_state_dict(assign=True)`): there is never a second copy of a weight. Parts can be left
out (`skip`) so that tensor mode reads only its own slices of the big per-block linears.

Every NVFP4 linear may also carry ModelOpt's optional `.input_scale` (F32 `[]`, the static
activation global scale `amax / (6 * 448)` the fp4 GEMM quantizes its input with); the loader
keeps it, and prepares each linear for its device's matmul path (`NVFP4Linear.prepare`) once,
at load.

The synthetic checkpoint is deterministic from (config, seed): every tensor is drawn from its own
generator seeded by (seed, tensor name), so the file does not depend on write order. Like a
ModelOpt export it carries an `input_scale` for every NVFP4 linear, calibrated as ModelOpt does:
the amax of the linear's input over a calibration pass (the synthetic text encoder on a fixed
prompt, seeded noise at the preset's size with one latent frame, 4 Euler steps), rounded up to
3 significant bits (so that the last-bit differences of another machine's GEMMs do not change
the file), divided by 6 * 448. It is cached on disk: a second run with the same config and seed
reads it instead of rebuilding it.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from h3core.config import ModelConfig
from h3core.errors import CheckpointError
from h3core.model import H3Model
from h3core.nvfp4 import layout
from h3core.nvfp4.codec import GLOBAL_SCALE_DIVISOR, quantize
from h3core.nvfp4.io import SafetensorsReader, linear_tensors, read_linear
from h3core.nvfp4.linear import NVFP4Linear
from h3core.partition import ColumnSlice, Span
from h3core.paths import free_bytes, os_error_reason, path_kind

if TYPE_CHECKING:
    from h3core.plan import ParallelPlan, WeightBytes

FORMAT = "h3-nvfp4"
FORMAT_VERSION = "1"
SYNTHETIC = "synthetic"
_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SYNTHETIC_GENERATOR_VERSION = "2"  # bump when the synthetic weights change, to invalidate caches (2: input_scale)
_NVFP4_EXTRAS = ("input_scale", "pre_quant_scale")
"""Optional per-linear tensors of a ModelOpt export, outside the model's own state dict."""


def nvfp4_prefixes(model: torch.nn.Module) -> list[str]:
    """Module names of every NVFP4 linear in `model`."""
    return [name for name, module in model.named_modules() if isinstance(module, NVFP4Linear)]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # the exact dtype for NVFP4 tensors; for dense ones, "some float dtype"
    nvfp4: bool


def schema(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor an H3 checkpoint for `config` holds, in state-dict order."""
    model = H3Model(config)
    quantized = tuple(f"{p}." for p in nvfp4_prefixes(model))
    specs = []
    for name, tensor in model.state_dict().items():
        packed = name.startswith(quantized) and not name.endswith(".bias")
        specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, packed))
    return specs


def _stored_bytes(spec: TensorSpec) -> int:
    """Bytes of a tensor as the contract stores it (dense ones in bf16)."""
    return math.prod(spec.shape) * (spec.dtype.itemsize if spec.nvfp4 else 2)


def _parameters(spec: TensorSpec) -> int:
    """Weights a tensor holds: packed NVFP4 bytes hold two each, scales hold none."""
    if spec.name.endswith(("weight_scale", "weight_scale_2")):
        return 0
    n = math.prod(spec.shape)
    return layout.unpacked_width(n) if spec.nvfp4 else n


def weight_bytes(config: ModelConfig, plan: "ParallelPlan") -> "WeightBytes":
    """The checkpoint's size for `config`, and what each rank of `plan` holds of it."""
    from h3core.parallel.tensor import sharded_prefixes
    from h3core.plan import Mode, WeightBytes

    specs = schema(config)
    block = sharded_prefixes(config.num_blocks)
    total = sum(_stored_bytes(s) for s in specs)
    block_full = sum(_stored_bytes(s) for s in specs if s.name.startswith(block))
    per_rank = [total] * plan.world_size
    if plan.mode is Mode.TENSOR:
        d, bias = config.hidden, 2  # bf16 biases

        def width(spans) -> int:
            return sum(x.stop - x.start for x in spans)

        per_rank = []
        for r in plan.ranks:
            t = r.tensor
            qkv, fc1 = width(t.qkv_rows), width(t.fc1_rows)  # column-parallel rows, biases sliced with them
            out, fc2 = width([t.attn_out_columns.elements]), width([t.fc2_columns.elements])  # row-parallel columns, full bias
            shard = (
                layout.storage_bytes(qkv, d) + qkv * bias
                + layout.storage_bytes(d, out) + d * bias
                + layout.storage_bytes(fc1, d) + fc1 * bias
                + layout.storage_bytes(d, fc2) + d * bias
            )
            per_rank.append(total - block_full + config.num_blocks * shard)
    return WeightBytes(
        parameters=sum(_parameters(s) for s in specs),
        checkpoint_bytes=total,
        nvfp4_bytes=sum(_stored_bytes(s) for s in specs if s.nvfp4),
        block_linears_bytes=block_full,
        per_rank=per_rank,
    )


# --- config in metadata --------------------------------------------------------------------------


def _metadata(config: ModelConfig, weights: str, **extra: str) -> dict[str, str]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": config.model_dump_json(),
        "weights": weights,
        **extra,
    }


def infer_config(reader: SafetensorsReader, base: ModelConfig, source: Path) -> ModelConfig:
    """Dimensions from tensor shapes; everything shapes cannot tell (geometry, defaults) from `base`.

    Every shape is checked before it is used (rank, non-empty dimensions, exact divisions), and the
    result is validated as a `ModelConfig`: a crafted or damaged file is one CheckpointError line.
    """

    def dim(name: str, axis: int, ndim: int) -> int:
        if name not in reader:
            raise CheckpointError(f"{source} has no tensor {name!r}: not an H3 checkpoint (see docs/checkpoint.md)")
        shape = tuple(reader.shape(name))
        if len(shape) != ndim or shape[axis] < 1:
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {list(shape)}, not a {ndim}-D tensor with a non-empty dimension {axis}; "
                "the file is damaged or not an H3 checkpoint"
            )
        return shape[axis]

    def exact(total: int, part: int, what: str) -> int:
        if total % part:
            raise CheckpointError(f"{source}: {what} ({total}) is not a multiple of {part}; the file is damaged or not an H3 checkpoint")
        return total // part

    hidden = dim("kind_embed", 1, 2)
    head_dim = dim("blocks.0.attn.norm_q.weight", 0, 1)
    pt, ph, pw = base.video_patch
    fields = dict(
        name="checkpoint",
        num_heads=exact(hidden, head_dim, "the model width"),
        head_dim=head_dim,
        num_blocks=_block_count(reader.keys(), source),
        mlp_width=layout.unpacked_width(dim("blocks.0.mlp.fc2.weight", 1, 2)),
        text_dim=layout.unpacked_width(dim("text_embed.weight", 1, 2)),
        time_embed_dim=layout.unpacked_width(dim("time_in.weight", 1, 2)),
        video_channels=exact(dim("video_embed.weight", 1, 2), pt * ph * pw, "the video patch width"),
        audio_channels=exact(dim("audio_embed.weight", 1, 2), base.audio_patch, "the audio patch width"),
    )
    try:
        return ModelConfig.model_validate({**base.model_dump(), **fields})
    except ValidationError as err:
        raise CheckpointError(f"{source}: its tensor shapes describe no valid H3 model ({err.errors()[0]['msg']})") from None


def _block_count(names: list[str], source: Path) -> int:
    """1 + the largest `i` of `blocks.<i>.…`; a name under `blocks.` that is not numbered is refused."""
    indices = []
    for name in names:
        if name.startswith("blocks."):
            index = name.split(".")[1]
            if not index.isdigit():
                raise CheckpointError(f"{source}: tensor {name!r} is not under a numbered block (blocks.<i>.…); not an H3 checkpoint")
            indices.append(int(index))
    if not indices:
        raise CheckpointError(f"{source} has no blocks.<i>.… tensors: not an H3 checkpoint (see docs/checkpoint.md)")
    return 1 + max(indices)


def _config_from(reader: SafetensorsReader, base: ModelConfig, source: Path) -> ModelConfig:
    meta = reader.metadata or {}
    inferred = infer_config(reader, base, source)
    if "config" not in meta:
        return inferred
    try:
        declared = ModelConfig.model_validate_json(meta["config"])
    except ValidationError as err:
        raise CheckpointError(f"{source}: its config metadata is invalid ({err.errors()[0]['msg']})") from None
    for field in ("num_heads", "head_dim", "num_blocks", "mlp_width", "text_dim", "time_embed_dim", "video_channels", "audio_channels"):
        if getattr(declared, field) != getattr(inferred, field):
            raise CheckpointError(
                f"{source}: metadata says {field}={getattr(declared, field)} but the tensor shapes "
                f"give {getattr(inferred, field)}; the file is inconsistent, re-export it"
            )
    return declared


# --- the loader ----------------------------------------------------------------------------------


class Checkpoint:
    """An opened H3 checkpoint: its reader, config and identity. Reads lazily."""

    def __init__(self, reader: SafetensorsReader, config: ModelConfig, weights: str, path: Path):
        self.reader = reader
        self.config = config
        self.weights = weights
        self.path = path

    @classmethod
    def open(cls, path: str | Path, base: ModelConfig) -> "Checkpoint":
        """Open and check a checkpoint; `base` supplies what the shapes cannot (resolution defaults)."""
        path = Path(path)
        kind = path_kind(path, follow=True)
        if kind == "nothing":
            raise CheckpointError(f"H3 checkpoint not found: {path}; set --model or H3_MODEL_PATH to an existing .safetensors file")
        if kind != "a file":
            raise CheckpointError(f"H3 checkpoint {path} is {kind}, not a file; set --model or H3_MODEL_PATH to the checkpoint's .safetensors file")
        reader = SafetensorsReader([path])
        meta = reader.metadata or {}
        if meta.get("format", FORMAT) != FORMAT:
            raise CheckpointError(f"{path} is a {meta['format']!r} file, not an H3 checkpoint ({FORMAT})")
        config = _config_from(reader, base, path)
        return cls(reader, config, meta.get("weights", "checkpoint"), path)

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def bytes_under(self, prefixes: tuple[str, ...]) -> int:
        """Stored bytes of every tensor whose name starts with one of `prefixes`."""
        return sum(
            math.prod(self.reader.shape(name)) * self.reader.dtype(name).itemsize
            for name in self.reader.keys()
            if name.startswith(prefixes)
        )

    def validate(self) -> list[TensorSpec]:
        """Check every tensor of the contract against the file; raise on the first missing or mismatched one."""
        specs = schema(self.config)
        keys = set(self.reader.keys())
        for spec in specs:
            if spec.name not in keys:
                raise CheckpointError(f"{self.path}: missing tensor {spec.name!r} (expected {list(spec.shape)}); the file is incomplete or not an H3 checkpoint")
            found_shape, found_dtype = tuple(self.reader.shape(spec.name)), self.reader.dtype(spec.name)
            if found_shape != spec.shape:
                raise CheckpointError(f"{self.path}: tensor {spec.name!r} has shape {list(found_shape)}, expected {list(spec.shape)}")
            if spec.nvfp4 and found_dtype != spec.dtype or not spec.nvfp4 and found_dtype not in _DENSE_DTYPES:
                raise CheckpointError(f"{self.path}: tensor {spec.name!r} has dtype {found_dtype}, expected {spec.dtype if spec.nvfp4 else 'bf16/fp16/fp32'}")
        self._validate_extras(specs)
        return specs

    def _validate_extras(self, specs: list[TensorSpec]) -> None:
        """Optional `input_scale` (F32 scalar) and `pre_quant_scale` (float `[in]`) of the NVFP4 linears."""
        for spec in specs:
            if not spec.name.endswith(".weight_scale_2"):
                continue
            prefix = spec.name.removesuffix(".weight_scale_2")
            in_features = layout.unpacked_width(self.reader.shape(f"{prefix}.weight")[1])
            wanted = {"input_scale": ((torch.float32,), ((), (1,))), "pre_quant_scale": (_DENSE_DTYPES, ((in_features,),))}
            for extra, (dtypes, shapes) in wanted.items():
                name = f"{prefix}.{extra}"
                if name in self.reader and (self.reader.dtype(name) not in dtypes or tuple(self.reader.shape(name)) not in shapes):
                    raise CheckpointError(
                        f"{self.path}: tensor {name!r} is {self.reader.dtype(name)} {list(self.reader.shape(name))}, "
                        f"expected {'float32 []' if extra == 'input_scale' else f'a float vector of {in_features}'}"
                    )

    def load(self, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, skip: tuple[str, ...] = ()) -> H3Model:
        """Build the model and assign its weights from disk; names under any `skip` prefix stay on meta."""
        specs = self.validate()
        model = H3Model(self.config)
        state = {}
        for spec in specs:
            if spec.name.startswith(skip):
                continue
            tensor = self.reader.get(spec.name).to(device)
            state[spec.name] = tensor if spec.nvfp4 else tensor.to(dtype)
        model.load_state_dict(state, strict=False, assign=True)
        self._load_nvfp4_extras(model, device, skip)
        prepare_nvfp4(model)
        return model.eval()

    def _load_nvfp4_extras(self, model: H3Model, device: torch.device | str, skip: tuple[str, ...]) -> None:
        """Each NVFP4 linear's optional `input_scale` / `pre_quant_scale`, where the file has them."""
        for prefix in nvfp4_prefixes(model):
            if f"{prefix}.".startswith(skip):
                continue
            linear = model.get_submodule(prefix)
            for extra in _NVFP4_EXTRAS:
                if f"{prefix}.{extra}" in self.reader:
                    setattr(linear, extra, self._extra(prefix, extra).to(device))

    def _extra(self, prefix: str, extra: str) -> torch.Tensor:
        tensor = self.reader.get(f"{prefix}.{extra}")
        if extra == "input_scale":
            value = tensor.float().reshape(())
            if not (0 < float(value) < math.inf):
                raise CheckpointError(f"{self.path}: {prefix}.input_scale is {float(value)}; it must be positive and finite (corrupt file?)")
            return value
        return tensor

    def read_linear(self, prefix: str, *, rows: list[Span] | None = None, columns: ColumnSlice | None = None, device=None) -> NVFP4Linear:
        """One NVFP4 linear, or only its `rows` / block-aligned `columns`, read from disk."""
        return read_linear(self.reader, prefix, rows=rows, columns=columns, device=device)

    def tensor(self, name: str, *, device=None, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.reader.get(name)
        return t.to(device=device, dtype=dtype) if device or dtype else t


# --- the synthetic writer ------------------------------------------------------------------------


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
    from h3core.model import PackedSequence, patchify_audio, patchify_video, rope_table, token_positions
    from h3core.partition import SegmentKind
    from h3core.sampler import FlowMatchEuler, initial_noise
    from h3core.text import load_text_encoder, release_text_encoder

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


def write_checkpoint(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    """Write atomically: a temp file in the same folder, then rename; no half-written checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def prepare_nvfp4(model: torch.nn.Module) -> None:
    """Build every NVFP4 linear's matmul operands for its device's path (once, at load)."""
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module.prepare()


def cache_dir() -> Path:
    """Where synthetic checkpoints are cached: $H3_CACHE_DIR, else ~/.cache/h3."""
    return Path(os.environ.get("H3_CACHE_DIR") or Path.home() / ".cache" / "h3")


def synthetic_checkpoint(config: ModelConfig, seed: int = 0, directory: Path | None = None) -> tuple[Path, bool]:
    """Path of the cached synthetic checkpoint for (config, seed), writing it first if needed.

    Returns (path, built): `built` is False when the cached file was reused. A cached file that
    does not read back as that checkpoint (truncated, corrupt, another config) is derived data:
    it is rebuilt, never reported as a download to repeat. A cache folder that cannot take the
    file (read-only, full) is one line naming H3_CACHE_DIR, checked before the tensors are made.
    """
    key = hashlib.sha256(f"{config.model_dump_json()}|{seed}|{FORMAT_VERSION}|{_SYNTHETIC_GENERATOR_VERSION}".encode()).hexdigest()[:12]
    folder = directory or cache_dir()
    path = folder / f"synthetic-{config.name}-{key}.safetensors"
    if path.exists() and _is_cached_synthetic(path, config):
        return path, False
    expected = sum(_stored_bytes(s) for s in schema(config))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if free_bytes(folder) < expected:
            raise OSError(errno.ENOSPC, "not enough free space")
        write_checkpoint(synthetic_tensors(config, seed), path, _metadata(config, SYNTHETIC, seed=str(seed)))
    except OSError as err:
        raise CheckpointError(
            f"cannot write the synthetic checkpoint ({expected / 2**20:.0f} MiB) to the cache folder {folder}: "
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


