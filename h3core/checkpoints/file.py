"""`TransformerFile`: an opened H3 transformer checkpoint in any layout, read by original names.

Detection (`open_transformer`) looks at the contents, never the file name:

- a folder holding `diffusion_pytorch_model*.safetensors` with diffusers names
  (`transformer_blocks.0.attn.to_q.weight`): the diffusers `transformer/` folder (its
  `config.json` read too);
- a folder holding `model.safetensors.index.json` shards with original names: the official
  MiniMax release, whose `qkv_proj` rows are per-head interleaved;
- a single file with original names (after stripping an optional `model.diffusion_model.`): a
  Comfy single file, `qkv_proj` stacked. A folder that holds a `transformer/` folder is read there.

Each linear is stored dense (BF16/F16/F32) or NVFP4, told apart per linear by its tensors: a
`<prefix>.comfy_quant` marker (or the legacy metadata table) means the Comfy layout (high nibble
first, swizzled scales; `h3core.nvfp4.comfy`); U8 codes with row-major F8 `weight_scale` and no
marker mean the ModelOpt layout h3 has always read (`h3core.nvfp4.io`). A marker naming another
format (int8, fp8, ...) is refused in one line that names it; so is one that says nvfp4 over a
tensor that is not U8.

Every read goes through one `SafetensorsReader` (only the bytes asked for, counted in
`bytes_read`): a tensor-parallel rank reads its rows or columns of a linear, whatever the layout
(stored row maps from `h3core.checkpoints.names`, scale tiles from `h3core.nvfp4.comfy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch

from h3core.checkpoints import names
from h3core.checkpoints.names import Piece
from h3core.errors import CheckpointError
from h3core.files.paths import path_kind
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, INDEX_FILE, SafetensorsReader, shard_files
from h3core.files.text import MAX_CONFIG_BYTES, read_json
from h3core.nvfp4 import comfy, layout
from h3core.nvfp4.codec import NVFP4Weight
from h3core.nvfp4.io import check_linear_header, check_values, read_linear
from h3core.nvfp4.kernels import DeviceKernels
from h3core.nvfp4.layout import ColumnSlice
from h3core.nvfp4.linear import DenseLinear, NVFP4Linear
from h3core.span import Span

Layout = Literal["comfy", "official", "diffusers"]
Storage = Literal["dense", "nvfp4-comfy", "nvfp4-modelopt"]

DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
DIFFUSERS_CONFIG = "config.json"
_ORIGINAL_PROBE = "blocks.0.attn.qkv_proj.weight"
_DIFFUSERS_PROBE = "transformer_blocks.0.attn.to_q.weight"


@dataclass
class TransformerFile:
    """An H3 transformer checkpoint, by original tensor names (module docstring)."""

    path: Path
    layout: Layout
    reader: SafetensorsReader
    pieces: dict[str, list[Piece]]
    markers: dict[str, comfy.ComfyQuant] = field(default_factory=dict)
    config_json: dict | None = None

    # --- what is in it ---------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return sorted(self.pieces)

    def __contains__(self, name: str) -> bool:
        return name in self.pieces

    has = __contains__

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape (a fused tensor's rows counted over all its pieces)."""
        pieces = self._pieces(name)
        stored = self.reader.shape(pieces[0].source)
        return stored if not stored else (max(p.stop for p in pieces),) + stored[1:]

    def dtype_name(self, name: str) -> str:
        return self.reader.dtype_name(self._pieces(name)[0].source)

    @property
    def metadata(self) -> dict[str, str]:
        return self.reader.metadata

    @property
    def files(self) -> list[Path]:
        return self.reader.paths

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.files)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def tensor_bytes(self, name: str) -> int:
        return sum(self.reader.nbytes(source) for source in dict.fromkeys(p.source for p in self._pieces(name)))

    def storage(self, prefix: str) -> Storage:
        """How linear `prefix` is stored (raises, naming it, for a format h3 does not compute with)."""
        weight = f"{prefix}.weight"
        dtype = self.dtype_name(weight)
        marker = self.markers.get(prefix)
        if marker is not None:
            if marker.format != comfy.NVFP4:
                raise CheckpointError(
                    f"{self.path}: {prefix} is quantized as {marker.format!r}; h3 computes with nvfp4 and bf16/fp16/fp32 "
                    "weights: use the bf16 or the nvfp4 checkpoint"
                )
            if dtype != "U8" or f"{prefix}.weight_scale" not in self:
                raise CheckpointError(f"{self.path}: {prefix}.comfy_quant says nvfp4 but {weight} is {dtype}; the file is corrupt")
            return "nvfp4-comfy"
        if dtype == "U8" and f"{prefix}.weight_scale" in self:
            return "nvfp4-modelopt"
        if dtype in FLOAT_DTYPE_NAMES:
            return "dense"
        raise CheckpointError(f"{self.path}: {weight} is {dtype} with no quantization marker; h3 reads nvfp4 and bf16/fp16/fp32 weights")

    def full_precision(self, prefix: str) -> bool:
        """A Comfy marker's `full_precision_matrix_mult`: dequantize and run a bf16 GEMM, never fp4 x fp4."""
        marker = self.markers.get(prefix)
        return bool(marker and marker.full_precision_matrix_mult)

    def check_headers(self, prefix: str, shape: tuple[int, int]) -> None:
        """Every stored tensor of linear `prefix` (logical `out x in`) has the dtype and shape its storage
        implies: its scales, global scale and bias, from the headers, before any weight is read."""
        storage, stored = self.storage(prefix), self._stored_prefix(prefix)
        if storage == "nvfp4-comfy":
            comfy.check_nvfp4_headers(self.reader, stored, *shape)
        elif storage == "nvfp4-modelopt":
            check_linear_header(self.reader, stored)
        elif f"{prefix}.bias" in self and self.shape(f"{prefix}.bias") != (shape[0],):
            raise CheckpointError(f"{self.path}: {prefix}.bias has shape {list(self.shape(f'{prefix}.bias'))}, the model needs {[shape[0]]}")

    def linear_shape(self, prefix: str) -> tuple[int, int]:
        """`(out, in)` of linear `prefix` as stored (a Comfy NVFP4 linear's padded shape)."""
        shape = self.shape(f"{prefix}.weight")
        if len(shape) != 2:
            raise CheckpointError(f"{self.path}: {prefix}.weight has shape {list(shape)}; a linear's weight is 2-D (the file is damaged)")
        out, width = shape
        return (out, width) if self.storage(prefix) == "dense" else (out, layout.unpacked_width(width))

    # --- reading ---------------------------------------------------------------------------------------

    def tensor(self, name: str, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole logical tensor, in its stored dtype, or in `dtype` where it goes to the CPU
        (converted as it is read: `SafetensorsReader.get`; a GPU converts faster than a CPU, after
        the smaller copy)."""
        pieces, dtype = self._pieces(name), _read_dtype(device, dtype)
        if len(pieces) == 1 and pieces[0].offset == 0:
            return self.reader.get(pieces[0].source, dtype).to(device)
        return self._rows(name, [Span(0, self.shape(name)[0])], dtype).to(device)

    def linear(self, prefix: str, *, shape: tuple[int, int], rows: Sequence[Span] | None = None,
               columns: ColumnSlice | None = None, device: torch.device | str = "cpu", kernels: DeviceKernels | None = None,
               dtype: torch.dtype | None = None) -> DenseLinear | NVFP4Linear:
        """Linear `prefix` of logical `shape` (out, in): whole, its output `rows` (bias rows with them),
        or its input `columns` (no bias: the caller adds it once after a reduction). An NVFP4 linear is
        prepared for the path `kernels` (its device's facts; None: the device's own) give it. A dense
        linear going to the CPU is read in `dtype` (as `tensor`); NVFP4's tensors keep their formats."""
        if rows is not None and columns is not None:
            raise ValueError("a linear shard takes rows or columns, not both")
        storage = self.storage(prefix)
        if storage == "dense":
            return self._dense(prefix, shape, rows, columns, device, _read_dtype(device, dtype))
        if storage == "nvfp4-modelopt":
            return read_linear(self.reader, self._stored_prefix(prefix), rows=rows, columns=columns, device=device, kernels=kernels)
        return self._comfy(prefix, shape, rows, columns, device, kernels)

    def _pieces(self, name: str) -> list[Piece]:
        if name not in self.pieces:
            raise CheckpointError(f"{self.path} has no tensor {name!r}; the checkpoint does not match this model (see docs/checkpoint.md)")
        return self.pieces[name]

    def _rows(self, name: str, spans: Sequence[Span], dtype: torch.dtype | None = None) -> torch.Tensor:
        reads = names.stored_rows(self._pieces(name), list(spans))
        parts = [self.reader.get_rows(source, [rows], dtype) for source, rows in reads]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _stored_prefix(self, prefix: str) -> str:
        return self._pieces(f"{prefix}.weight")[0].source.removesuffix(".weight")

    def _dense(self, prefix: str, shape: tuple[int, int], rows: Sequence[Span] | None, columns: ColumnSlice | None,
               device: torch.device | str, dtype: torch.dtype | None = None) -> DenseLinear:
        weight_name, bias_name = f"{prefix}.weight", f"{prefix}.bias"
        if self.shape(weight_name) != tuple(shape):
            raise CheckpointError(f"{self.path}: {weight_name} is {list(self.shape(weight_name))}, the model needs {list(shape)}")
        has_bias = bias_name in self
        if rows is not None:
            weight, bias = self._rows(weight_name, rows, dtype), self._rows(bias_name, rows, dtype) if has_bias else None
        elif columns is not None:
            (piece,) = self._pieces(weight_name)  # out_proj and fc2: stored whole in every layout
            weight, bias = self.reader.get_columns(piece.source, columns.elements), None
        else:
            weight, bias = self.tensor(weight_name, dtype=dtype), self.tensor(bias_name, dtype=dtype) if has_bias else None
        return DenseLinear(weight.to(device), None if bias is None else bias.to(device))

    def _comfy(self, prefix: str, shape: tuple[int, int], rows: Sequence[Span] | None, columns: ColumnSlice | None,
               device: torch.device | str, kernels: DeviceKernels | None) -> NVFP4Linear:
        out_features, in_features = shape
        stored = self._stored_prefix(prefix)
        packed_name, scale_name = f"{stored}.weight", f"{stored}.weight_scale"
        packed_shape, scale_shape = self.reader.shape(packed_name), self.reader.shape(scale_name)
        comfy.check_comfy_shapes(packed_shape, scale_shape, out_features, in_features, f"{self.path}: {prefix}")
        if self.reader.dtype_name(scale_name) != "F8_E4M3":
            raise CheckpointError(f"{self.path}: {scale_name} is {self.reader.dtype_name(scale_name)}, an NVFP4 block scale is F8_E4M3")
        rows_128, cols_4 = scale_shape
        scale_cols = layout.scale_columns(in_features)
        if rows is not None:
            _check_rows(rows, out_features, prefix)
            packed = self.reader.get_rows(packed_name, list(rows))[:, : layout.packed_bytes(in_features)]
            scale = torch.cat([comfy.rows_from_tiles(self.reader.get_bytes(scale_name, [comfy.scale_row_tiles(span, cols_4)]), span, cols_4, scale_cols)
                               for span in rows])
        elif columns is not None:
            if columns.elements.stop > in_features or not len(columns.elements):
                raise CheckpointError(f"{prefix}: columns {columns.elements} are outside its {in_features} inputs")
            packed = self.reader.get_columns(packed_name, columns.packed_bytes)[:out_features]
            raw = self.reader.get_bytes(scale_name, comfy.scale_column_tiles(columns.scale_columns, rows_128, cols_4))
            scale = comfy.columns_from_tiles(raw, columns.scale_columns, rows_128, out_features)
        else:
            packed = self.reader.get(packed_name)[:out_features, : layout.packed_bytes(in_features)]
            scale = comfy.rows_from_tiles(self.reader.get(scale_name).view(torch.uint8).reshape(-1), Span(0, out_features), cols_4, scale_cols)
        global_scale = self.reader.get(f"{stored}.weight_scale_2").float().reshape(())
        check_values(self.reader, prefix, scale, global_scale)
        weight = NVFP4Weight(comfy.swap_nibbles_(packed.contiguous()), scale.contiguous(), global_scale)  # packed: this read's own bytes
        extras = {name: self.reader.get(f"{stored}.{name}") for name in ("input_scale",) if f"{stored}.{name}" in self.reader}
        pre = f"{stored}.pre_quant_scale"
        pre_scale = None
        if pre in self.reader:
            pre_scale = self.reader.get(pre) if columns is None else self.reader.get_columns(pre, columns.elements)
        bias = None
        if f"{stored}.bias" in self.reader and columns is None:
            bias = self.reader.get(f"{stored}.bias") if rows is None else self.reader.get_rows(f"{stored}.bias", list(rows))
        linear = NVFP4Linear(weight, bias, pre_scale, extras.get("input_scale")).to(device)
        if self.full_precision(prefix):  # the marker's full_precision_matrix_mult: dequantize and multiply, never fp4 (nor emulated)
            linear.fp4_matmul, linear.emulate_fp4 = False, False
        linear.kernels = kernels
        linear.prepare()
        return linear


def _check_rows(rows: Sequence[Span], out_features: int, prefix: str) -> None:
    if not rows or any(not len(s) or s.stop > out_features for s in rows):
        raise CheckpointError(f"{prefix}: rows {list(rows)} are empty or outside its {out_features} outputs")


# --- detection -----------------------------------------------------------------------------------------


def open_transformer(path: str | Path) -> TransformerFile:
    """Open an H3 transformer checkpoint of any layout, detected from its contents (module docstring)."""
    path = Path(path)
    kind = path_kind(path, follow=True)
    if kind == "nothing":
        raise CheckpointError(f"H3 checkpoint not found: {path}; set --model or H3_MODEL_PATH to a .safetensors file or a transformer folder")
    if kind == "a folder":
        return _open_folder(path)
    if kind != "a file":
        raise CheckpointError(f"H3 checkpoint {path} is {kind}, not a file or folder; set --model or H3_MODEL_PATH to a .safetensors file or a transformer folder")
    return _classify(path, SafetensorsReader([path]), folder=False)


def _open_folder(folder: Path) -> TransformerFile:
    if (folder / "transformer").is_dir() and not any(folder.glob("*.safetensors")):
        folder = folder / "transformer"
    index = DIFFUSERS_INDEX if (folder / DIFFUSERS_INDEX).is_file() else INDEX_FILE
    files = shard_files(folder, index)
    config = None
    if (folder / DIFFUSERS_CONFIG).is_file():
        config = read_json(folder / DIFFUSERS_CONFIG, "the transformer's config", MAX_CONFIG_BYTES, "download the checkpoint again",
                           error=CheckpointError, want=dict)
    opened = _classify(folder, SafetensorsReader(files), folder=True)
    opened.config_json = config
    return opened


def _classify(path: Path, reader: SafetensorsReader, folder: bool) -> TransformerFile:
    """Which layout the reader's tensors are in (module docstring), as a `TransformerFile`."""
    keys = reader.keys()
    prefix = names.COMFY_PREFIX if keys and all(k.startswith(names.COMFY_PREFIX) for k in keys) else ""
    stripped = {k[len(prefix):]: k for k in keys}
    try:
        if _DIFFUSERS_PROBE in stripped:
            pieces = _diffusers_pieces(reader, stripped)
            return TransformerFile(path, "diffusers", reader, pieces)
        if _ORIGINAL_PROBE in stripped:
            markers = _markers(reader, stripped, path)
            layout_name: Layout = "official" if folder else "comfy"
            pieces = _original_pieces(reader, stripped, interleaved=layout_name == "official")
            return TransformerFile(path, layout_name, reader, pieces, markers)
    except BaseException:
        reader.close()
        raise
    reader.close()
    sample = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "") if keys else "no tensors"
    raise CheckpointError(
        f"{path} is not an H3 transformer checkpoint: found {sample}; expected {_ORIGINAL_PROBE} (a Comfy single file or "
        f"the official shards) or {_DIFFUSERS_PROBE} (a diffusers transformer/ folder)"
    )


def _markers(reader: SafetensorsReader, stripped: dict[str, str], path: Path) -> dict[str, comfy.ComfyQuant]:
    suffix = f".{comfy.MARKER}"
    markers = comfy.legacy_markers(reader.metadata, str(path))
    for name, stored in stripped.items():
        if name.endswith(suffix):
            markers[name.removesuffix(suffix)] = comfy.read_marker(reader, stored, str(path))
    return markers


def _original_pieces(reader: SafetensorsReader, stripped: dict[str, str], interleaved: bool) -> dict[str, list[Piece]]:
    pieces = {}
    for name, stored in stripped.items():
        if name.endswith(f".{comfy.MARKER}"):
            continue
        if interleaved and name.endswith(".attn.qkv_proj.weight"):
            head_dim = _head_dim(reader, stripped, name.replace("qkv_proj.weight", "q_norm.weight"))
            rows = _rows(reader, stored, multiple=3 * head_dim, what=f"3 x the head width {head_dim} (q, k and v per head)")
            pieces[name] = names.interleaved_qkv(stored, rows // (3 * head_dim), head_dim)
        else:
            pieces[name] = names.whole(stored, _leading(reader, stored))
    return pieces


def _diffusers_pieces(reader: SafetensorsReader, stripped: dict[str, str]) -> dict[str, list[Piece]]:
    pieces: dict[str, list[Piece]] = {}
    for name, stored in stripped.items():
        original = names.from_diffusers(name)
        if original.endswith(".attn.qkv_proj.weight"):
            if original not in pieces:
                base = name.rsplit(".to_", 1)[0]
                sources = tuple(stripped.get(f"{base}.to_{p}.weight", "") for p in "qkv")
                if not all(sources):
                    raise CheckpointError(f"{reader.paths[0].parent}: {base} lacks one of to_q/to_k/to_v; the checkpoint is incomplete")
                shapes = {reader.shape(s) for s in sources}
                if len(shapes) != 1:
                    raise CheckpointError(f"{reader.paths[0].parent}: {base}.to_q/to_k/to_v have shapes {[list(reader.shape(s)) for s in sources]}, not one shape; the file is damaged")
                pieces[original] = names.split_qkv(sources, _rows(reader, sources[0], multiple=1, what="1"))  # type: ignore[arg-type]
        elif original.endswith(".mlp.fc1.weight"):
            pieces[original] = names.swapped_halves(stored, _rows(reader, stored, multiple=2, what="2 (its up and gate halves)") // 2)
        else:
            pieces[original] = names.whole(stored, _leading(reader, stored))
    return pieces


# --- the shapes the pieces are cut by: checked before any arithmetic on them ----------------------------


def _leading(reader: SafetensorsReader, stored: str) -> int:
    """Rows (dim 0) of a tensor, 0 for a scalar (read whole, never by rows)."""
    shape = reader.shape(stored)
    return shape[0] if shape else 0


def _rows(reader: SafetensorsReader, stored: str, *, multiple: int, what: str) -> int:
    """Rows of a fused linear's weight that is cut into pieces: 2-D, and a positive multiple of `multiple`."""
    shape = reader.shape(stored)
    if len(shape) != 2 or not shape[0] or shape[0] % multiple:
        raise CheckpointError(
            f"{reader.file_of(stored)}: tensor {stored!r} has shape {list(shape)}; its rows must be a positive multiple of {what} "
            "(a 2-D weight); the file is damaged or not an H3 checkpoint"
        )
    return shape[0]


def _head_dim(reader: SafetensorsReader, stripped: dict[str, str], q_norm: str) -> int:
    """The head width, from the length of a block's q_norm (the official shards interleave qkv by it)."""
    if q_norm not in stripped:
        raise CheckpointError(f"{reader.paths[0].parent} has no tensor {q_norm!r}: the official shards' qkv rows are cut by its length; the checkpoint is incomplete")
    shape = reader.shape(stripped[q_norm])
    if len(shape) != 1 or not shape[0]:
        raise CheckpointError(f"{reader.file_of(stripped[q_norm])}: tensor {q_norm!r} has shape {list(shape)}, not the head width (a non-empty 1-D tensor); the file is damaged")
    return shape[0]


def _read_dtype(device: torch.device | str, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype to convert to as the bytes are read: `dtype` for the CPU, None (the stored dtype) for a GPU."""
    return dtype if torch.device(device).type == "cpu" else None
