"""Loading an H3 transformer from any checkpoint layout (`h3core.checkpoints`), and its config.

`Checkpoint.open(path, base)` detects the layout from the contents (a Comfy single file, bf16 or
NVFP4, full or AdaLN-pruned; the official shards; the diffusers `transformer/` folder; the ModelOpt
NVFP4 layout), infers the model's dimensions from the tensor shapes (a diffusers `config.json`
supplies what shapes cannot: RoPE base, epsilon) and takes what no file says (the run's default
resolution and steps) from `base`, the preset. `load` builds the model on the meta device and fills
every slot from the file: there is never a second copy of a weight. Dense tensors load in the
stream dtype except the float32 islands (`H3Model.fp32_module`); NVFP4 linears keep their packed
format, each prepared for its device's matmul path once, here.

Tensor mode leaves its block linears out of `load` (`skip`) and reads its shards through
`weight_source` (only their rows or columns, in any layout).

`load_transformer(path, dtype=None, device="cpu")` is the public entry point outside checks call
(docs/checkpoint.md): the model; `h3core.model.packing.diffusers_forward(model, **diffusers_inputs)`
runs it in diffusers' argument names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from pydantic import ValidationError

from h3core.checkpoints import numbered
from h3core.checkpoints.file import TransformerFile, open_transformer
from h3core.errors import CheckpointError
from h3core.model.config import ModelConfig
from h3core.model.dit import H3Model, rope_inv_freq
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear
from h3core.span import Span

SYNTHETIC = "synthetic"
WEIGHTS_KEY = "h3_weights"
"""Metadata key of h3's synthetic files (`synthetic`); any other file reports its own path."""


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: its (original) name, stored shape and safetensors dtype, and its bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @property
    def prefix(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def parameters(self) -> int:
        """Weights it holds: packed NVFP4 bytes hold two each, scales and markers none."""
        if self.name.endswith((".weight_scale", ".weight_scale_2", ".input_scale", ".comfy_quant")):
            return 0
        n = math.prod(self.shape)
        return 2 * n if self.dtype == "U8" and self.name.endswith(".weight") else n


def linear_slots(model: torch.nn.Module) -> list[tuple[str, DenseLinear]]:
    """Every linear slot of a freshly built model (name, module), in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, DenseLinear)]


# --- the config a file describes -------------------------------------------------------------------


def infer_config(file: TransformerFile, base: ModelConfig) -> ModelConfig:
    """Dimensions from tensor shapes (and a diffusers config.json); the run's defaults from `base`.

    Every shape is checked before it is used and the result is validated as a `ModelConfig`: a
    crafted or damaged file is one CheckpointError line.
    """
    hidden, patch_dim = _dims(file, "video_patch_proj.weight", 2)
    head_dim = _dims(file, "blocks.0.attn.q_norm.weight", 1)[0]
    attention = _linear_in(file, "blocks.0.attn.out_proj")
    pt, ph, pw = base.patch
    fields: dict = dict(
        name="checkpoint", hidden=hidden, head_dim=head_dim, num_heads=_exact(file, attention, head_dim, "the attention width"),
        num_blocks=_count(file, "blocks."), refiner_blocks=_count(file, "token_refiner.blocks."),
        ffn_dim=_linear_in(file, "blocks.0.mlp.fc2"), text_dim=_dims(file, "condition_proj.weight", 2)[1],
        video_channels=_exact(file, patch_dim, pt * ph * pw, "the video patch width"),
        audio_channels=_dims(file, "audio_patch_proj.weight", 2)[1],
    )
    if "adaln_t_table" in file:
        rows, rank = _dims(file, "adaln_t_table", 2)
        fields.update(pruned=True, table_rows=rows, time_embed_dim=rank, time_hidden=base.time_hidden)
    else:
        time_hidden, freq_dim = _dims(file, "time_embedder.proj_in.weight", 2)
        fields.update(pruned=False, time_embed_dim=_dims(file, "time_embedder.proj_out.weight", 2)[0], time_hidden=time_hidden, freq_dim=freq_dim)
    if "rope.inv_freq" in file:
        fields["rope_freq_dim"] = _dims(file, "rope.inv_freq", 1)[0]
    extra = file.config_json or {}
    for ours, theirs in (("rope_freq_dim", "rope_freq_dim"), ("rope_theta", "rope_theta"), ("norm_eps", "norm_eps")):
        if theirs in extra:
            fields[ours] = extra[theirs]
    try:
        config = ModelConfig.model_validate({**base.model_dump(), **fields})
    except ValidationError as err:
        raise CheckpointError(f"{file.path}: its tensor shapes describe no valid H3 model ({err.errors()[0]['msg']})") from None
    _check_rope(file, config)
    return config


def _dims(file: TransformerFile, name: str, ndim: int) -> tuple[int, ...]:
    if name not in file:
        raise CheckpointError(f"{file.path} has no tensor {name!r}: not an H3 transformer checkpoint (see docs/checkpoint.md)")
    shape = file.shape(name)
    if len(shape) != ndim or not all(shape):
        raise CheckpointError(f"{file.path}: tensor {name!r} has shape {list(shape)}, not a non-empty {ndim}-D tensor; the file is damaged")
    return shape


def _linear_in(file: TransformerFile, prefix: str) -> int:
    _dims(file, f"{prefix}.weight", 2)
    return file.linear_shape(prefix)[1]


def _exact(file: TransformerFile, total: int, part: int, what: str) -> int:
    if total % part:
        raise CheckpointError(f"{file.path}: {what} ({total}) is not a multiple of {part}; the file is damaged or not an H3 checkpoint")
    return total // part


def _count(file: TransformerFile, under: str) -> int:
    """How many blocks `<under><i>.…` there are, numbered 0..n-1 without a gap (`h3core.checkpoints.numbered`:
    a name there that is not numbered, or numbered past any sane count, is refused; nothing is sized by a number)."""
    try:
        indices = numbered.indices_under(file.keys(), under)
    except numbered.BadIndex as err:
        raise CheckpointError(f"{file.path}: {err}; not an H3 checkpoint") from None
    count = numbered.contiguous_count(indices)
    if count is None:
        raise CheckpointError(f"{file.path}: blocks {numbered.missing(indices)} under {under!r} are missing (the largest is {max(indices):,}); the file is incomplete")
    return count


def _check_rope(file: TransformerFile, config: ModelConfig) -> None:
    if "rope.inv_freq" not in file:
        return
    stored = file.tensor("rope.inv_freq").float()
    if not torch.allclose(stored, rope_inv_freq(config), rtol=1e-6, atol=0):
        raise CheckpointError(f"{file.path}: rope.inv_freq is not 10000^(-j/{config.rope_freq_dim}) (theta {config.rope_theta}); not an H3 checkpoint h3 knows")


# --- the loader ----------------------------------------------------------------------------------------


class Checkpoint:
    """An opened H3 checkpoint: its file (any layout), config and identity. Reads lazily."""

    def __init__(self, file: TransformerFile, config: ModelConfig):
        self.file = file
        self.config = config

    @classmethod
    def open(cls, path: str | Path, base: ModelConfig) -> "Checkpoint":
        """Open a checkpoint of any layout; `base` supplies what the shapes cannot (resolution defaults)."""
        file = open_transformer(path)
        return cls(file, infer_config(file, base))

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def weights(self) -> str:
        """`synthetic` for h3's synthetic files, else `checkpoint`."""
        return SYNTHETIC if self.file.metadata.get(WEIGHTS_KEY) == SYNTHETIC else "checkpoint"

    @property
    def size_bytes(self) -> int:
        return self.file.size_bytes

    @property
    def bytes_read(self) -> int:
        return self.file.bytes_read

    def specs(self) -> list[TensorSpec]:
        """Every stored tensor, by original name (a diffusers folder's to_q/k/v counted as its qkv_proj)."""
        reader = self.file.reader
        out = []
        for name in self.file.keys():
            out.append(TensorSpec(name, self.file.shape(name), self.file.dtype_name(name), self.file.tensor_bytes(name)))
        markers = [n for n in reader.keys() if n.endswith(".comfy_quant")]
        out.extend(TensorSpec(n, reader.shape(n), "U8", reader.nbytes(n)) for n in markers)
        return out

    def bytes_under(self, prefixes: tuple[str, ...]) -> int:
        """Stored bytes of every tensor whose name starts with one of `prefixes`."""
        return sum(spec.nbytes for spec in self.specs() if spec.name.startswith(prefixes))

    def validate(self, model: H3Model | None = None) -> None:
        """Check every tensor the model needs against the file (names, shapes, dtypes); raise on the first
        problem. `model`: the meta skeleton to check against (default: a new one)."""
        model = model if model is not None else H3Model(self.config)
        for prefix, slot in linear_slots(model):
            self._check_linear(prefix, slot)
        for name, buf in _plain_tensors(model):
            if name not in self.file:
                raise CheckpointError(f"{self.path}: missing tensor {name!r} (expected {list(buf.shape)}); the file is incomplete or not an H3 checkpoint")
            if self.file.shape(name) != tuple(buf.shape):
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(self.file.shape(name))}, expected {list(buf.shape)}")
            if self.file.dtype_name(name) not in ("BF16", "F16", "F32"):
                raise CheckpointError(f"{self.path}: tensor {name!r} is {self.file.dtype_name(name)}, expected bf16/fp16/fp32")

    def _check_linear(self, prefix: str, slot: DenseLinear) -> None:
        if f"{prefix}.weight" not in self.file:
            raise CheckpointError(f"{self.path}: missing tensor {prefix}.weight; the file is incomplete or not an H3 checkpoint")
        shape = (slot.out_features, slot.in_features)
        stored = self.file.linear_shape(prefix)
        if self.file.storage(prefix) == "nvfp4-comfy":
            wanted = (-(-shape[0] // 16) * 16, -(-shape[1] // 16) * 16)
        else:
            wanted = shape
        if stored != wanted:
            raise CheckpointError(f"{self.path}: linear {prefix} is {list(stored)}, the model needs {list(shape)}; the file does not match its own config")
        if (slot.bias is not None) != (f"{prefix}.bias" in self.file):
            raise CheckpointError(f"{self.path}: linear {prefix} {'lacks' if slot.bias is not None else 'has'} a bias; not an H3 checkpoint layout h3 knows")
        self.file.check_headers(prefix, shape)

    def load(self, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, skip: tuple[str, ...] = (),
             kernels: DeviceKernels | None = None) -> H3Model:
        """Build the model and fill it from disk; linears under a `skip` prefix stay empty slots. Every
        NVFP4 linear and attention kernel answers to `kernels` (the device's facts: the rank's, else
        the device's own, asked once)."""
        model = H3Model(self.config)  # on the meta device, built once: checked against, then filled
        self.validate(model)
        source = self.weight_source(device, dtype, model, kernels)
        plain = _plain_tensors(model)  # before the slots are filled: then every linear is still a slot
        for prefix, slot in linear_slots(model):
            if f"{prefix}.".startswith(skip):
                continue
            _set_module(model, prefix, source.linear(prefix))
        for name, _ in plain:
            _set_buffer(model, name, source.tensor(name))
        model.set_attention_backend(kernels=source.kernels)
        return model.eval()

    def weight_source(self, device: torch.device | str, dtype: torch.dtype, model: H3Model | None = None,
                      kernels: DeviceKernels | None = None) -> "CheckpointWeights":
        """This file as a `WeightSource` in the stream dtype `dtype` (tensor mode reads its shards through it)."""
        return CheckpointWeights(self.file, model or H3Model(self.config), torch.device(device), dtype, kernels)


def _plain_tensors(model: H3Model) -> list[tuple[str, torch.Tensor]]:
    """The tensors that are not linears: norm weights and the pruned variant's table."""
    linear_names = {name for name, _ in linear_slots(model)}
    return [(name, buf) for name, buf in model.named_buffers() if name.rsplit(".", 1)[0] not in linear_names]


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _set_buffer(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    (model.get_submodule(parent) if parent else model).register_buffer(leaf, tensor)


class CheckpointWeights:
    """A `WeightSource` over a checkpoint file for a model skeleton: linears (whole or a tensor-parallel
    shard, any layout) and plain tensors on `device`, dense ones in the stream dtype or float32 where
    the model keeps them so (`H3Model.fp32_module`). `kinds` records the storage of what was read."""

    def __init__(self, file: TransformerFile, skeleton: H3Model, device: torch.device, dtype: torch.dtype, kernels: DeviceKernels | None = None):
        self.file, self.skeleton, self.device, self.dtype = file, skeleton, device, dtype
        self.kernels = kernels or DeviceKernels.of(device)
        self.shapes = {prefix: (slot.out_features, slot.in_features) for prefix, slot in linear_slots(skeleton)}
        self.kinds: set[str] = set()

    def dtype_of(self, name: str) -> torch.dtype:
        return torch.float32 if self.skeleton.fp32_module(name) else self.dtype

    def has(self, name: str) -> bool:
        return name in self.file

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype_of(name)
        return self.file.tensor(name, self.device, dtype).to(dtype)

    def linear(self, prefix: str, *, rows: Sequence[Span] | None = None, columns: ColumnSlice | None = None) -> DenseLinear | NVFP4Linear:
        dtype = self.dtype_of(prefix)
        linear = self.file.linear(prefix, shape=self.shapes[prefix], rows=rows, columns=columns, device=self.device, kernels=self.kernels, dtype=dtype)
        self.kinds.add("dense" if isinstance(linear, DenseLinear) else "nvfp4")
        return linear.to(dtype)


def load_transformer(path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                     loras: Sequence[str | Path | tuple[str | Path, float]] = ()) -> H3Model:
    """The transformer at `path` (any layout h3 reads), on `device`, streaming in `dtype` (default:
    bf16 on CUDA, float32 elsewhere). `h3core.model.packing.diffusers_forward(model, ...)` runs it on one
    packed sequence in diffusers' argument names and returns `(video, audio)` velocities (docs/checkpoint.md).

    `loras`: adapters to apply, each a path or `(path, scale)` (docs/lora.md): checked against the
    model first (one `AdapterError` line for anything wrong), then hung beside its linears as
    low-rank branches, the checkpoint's own weights untouched."""
    from h3core.model.config import preset

    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    checkpoint = Checkpoint.open(path, preset("h3"))
    model = checkpoint.load(device=device, dtype=dtype)
    if loras:
        from h3core.lora.adapter import open_adapter
        from h3core.lora.attach import attach_adapters
        from h3core.lora.spec import lora_spec

        specs = [lora_spec(entry) for entry in loras]
        attach_adapters(model, [(open_adapter(s.path, checkpoint.config), s.scale) for s in specs], dtype)
    return model

