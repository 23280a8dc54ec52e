"""The H3 checkpoint: its contract and the loader (the synthetic checkpoint's writer: `h3core.model.synthetic`).

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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError

from h3core.errors import CheckpointError
from h3core.files.paths import path_kind
from h3core.files.safetensors import SafetensorsReader
from h3core.model.config import ModelConfig
from h3core.model.dit import H3Model
from h3core.nvfp4 import layout
from h3core.nvfp4.io import CheckpointWeights
from h3core.nvfp4.linear import NVFP4Linear

FORMAT = "h3-nvfp4"
FORMAT_VERSION = "1"
SYNTHETIC = "synthetic"
_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
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


@functools.lru_cache(maxsize=16)
def schema(config: ModelConfig) -> tuple[TensorSpec, ...]:
    """Every tensor an H3 checkpoint for `config` holds, in state-dict order (built once per config)."""
    model = H3Model(config)
    quantized = tuple(f"{p}." for p in nvfp4_prefixes(model))
    specs = []
    for name, tensor in model.state_dict().items():
        packed = name.startswith(quantized) and not name.endswith(".bias")
        specs.append(TensorSpec(name, tuple(tensor.shape), tensor.dtype, packed))
    return tuple(specs)


DENSE_BYTES = 2
"""Dense tensors are stored in bf16 (what `stored_bytes` counts; a file may also hold fp16 or fp32)."""


def stored_bytes(spec: TensorSpec) -> int:
    """Bytes of a tensor as the contract stores it (dense ones in bf16)."""
    return math.prod(spec.shape) * (spec.dtype.itemsize if spec.nvfp4 else DENSE_BYTES)


def parameters(spec: TensorSpec) -> int:
    """Weights a tensor holds: packed NVFP4 bytes hold two each, scales hold none."""
    if spec.name.endswith(("weight_scale", "weight_scale_2")):
        return 0
    n = math.prod(spec.shape)
    return layout.unpacked_width(n) if spec.nvfp4 else n


# --- config in metadata --------------------------------------------------------------------------


def infer_config(reader: SafetensorsReader, base: ModelConfig, source: Path) -> ModelConfig:
    """Dimensions from tensor shapes; everything shapes cannot tell (geometry, defaults) from `base`.

    Every shape is checked before it is used (rank, non-empty dimensions, exact divisions), and the
    result is validated as a `ModelConfig`: a crafted or damaged file is one CheckpointError line.
    """
    hidden = _dim(reader, source, "kind_embed", 1, 2)
    head_dim = _dim(reader, source, "blocks.0.attn.norm_q.weight", 0, 1)
    pt, ph, pw = base.video_patch
    fields = dict(
        name="checkpoint",
        num_heads=_exact(source, hidden, head_dim, "the model width"),
        head_dim=head_dim,
        num_blocks=_block_count(reader.keys(), source),
        mlp_width=layout.unpacked_width(_dim(reader, source, "blocks.0.mlp.fc2.weight", 1, 2)),
        text_dim=layout.unpacked_width(_dim(reader, source, "text_embed.weight", 1, 2)),
        time_embed_dim=layout.unpacked_width(_dim(reader, source, "time_in.weight", 1, 2)),
        video_channels=_exact(source, _dim(reader, source, "video_embed.weight", 1, 2), pt * ph * pw, "the video patch width"),
        audio_channels=_exact(source, _dim(reader, source, "audio_embed.weight", 1, 2), base.audio_patch, "the audio patch width"),
    )
    try:
        return ModelConfig.model_validate({**base.model_dump(), **fields})
    except ValidationError as err:
        raise CheckpointError(f"{source}: its tensor shapes describe no valid H3 model ({err.errors()[0]['msg']})") from None


def _dim(reader: SafetensorsReader, source: Path, name: str, axis: int, ndim: int) -> int:
    """Dimension `axis` of tensor `name`, which must exist, be `ndim`-D and non-empty there."""
    if name not in reader:
        raise CheckpointError(f"{source} has no tensor {name!r}: not an H3 checkpoint (see docs/checkpoint.md)")
    shape = tuple(reader.shape(name))
    if len(shape) != ndim or shape[axis] < 1:
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {list(shape)}, not a {ndim}-D tensor with a non-empty dimension {axis}; "
            "the file is damaged or not an H3 checkpoint"
        )
    return shape[axis]


def _exact(source: Path, total: int, part: int, what: str) -> int:
    if total % part:
        raise CheckpointError(f"{source}: {what} ({total}) is not a multiple of {part}; the file is damaged or not an H3 checkpoint")
    return total // part


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

    def validate(self) -> tuple[TensorSpec, ...]:
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

    def _validate_extras(self, specs: tuple[TensorSpec, ...]) -> None:
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

    def weight_source(self, device: torch.device | str) -> CheckpointWeights:
        """This file as a `WeightSource` (tensor mode reads its shards through it: only their slices)."""
        return CheckpointWeights(self.reader, device)


def metadata(config: ModelConfig, weights: str, **extra: str) -> dict[str, str]:
    """The safetensors metadata of an H3 checkpoint of `config` (`weights`: 'synthetic' or an origin)."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "config": config.model_dump_json(), "weights": weights, **extra}


def prepare_nvfp4(model: torch.nn.Module) -> None:
    """Build every NVFP4 linear's matmul operands for its device's path (once, at load)."""
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module.prepare()
