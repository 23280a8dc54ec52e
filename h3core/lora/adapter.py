"""An adapter file opened against a model: its pairs on h3's linears, their scales, checked whole.

`open_adapter(path, config)` reads the safetensors header (`h3core.files.safetensors`: a damaged
file is one line), maps its keys (`h3core.lora.keys`), and checks every pair against the model's
linears before anything runs: 2-D float matrices, `A: [rank, in]` with the linear's input width,
`B: [rows, rank]` with the rank of A and the rows it adapts, a finite alpha; with `check_values`
(what `resolve` does) every value is read once and must be finite. A pruned checkpoint's AdaLN
projections read the rank-8 curve, not the full model's 2688 features: an adapter trained on the
full model's projections is refused with that reason.

The scale of a pair (`Pair.scale`, the adapter's own, before the user's `--lora PATH:SCALE`) is
`alpha / rank`, with alpha taken as diffusers 0.42.1 takes it (`MiniMaxH3LoraLoaderMixin.lora_state_dict`,
`peft_utils.get_peft_kwargs`, peft's `LoraLayer.update_layer`), first that applies:

1. the pair's own `alpha` tensor (kohya / ComfyUI);
2. the peft `LoraConfig` diffusers writes into `__metadata__["lora_adapter_metadata"]`
   (`lora_alpha`, `r`, their `alpha_pattern` / `rank_pattern`, `use_rslora`: `alpha / sqrt(rank)`);
3. a file-wide `__metadata__["alpha"]` (e.g. lightx2v's files): that alpha for every pair;
4. none of these: `alpha == rank`, scale 1.

`read_pair` hands a pair's matrices back in h3's row order (B's halves swapped for diffusers'
`ff.net.0.proj`, its per-head qkv rows stacked for DiffSynth-Studio's files).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3core.errors import AdapterError, CheckpointError
from h3core.files.paths import path_kind
from h3core.files.safetensors import FLOAT_DTYPE_NAMES, SafetensorsReader
from h3core.files.text import parse_json
from h3core.lora.keys import Format, KeyMap, PairKeys, RowOrder, map_keys
from h3core.lora.schedule import AdapterSchedule, read_schedule
from h3core.lora.spec import MAX_SCALE
from h3core.model.config import ModelConfig
from h3core.nvfp4.linear import DenseLinear

PEFT_METADATA = "lora_adapter_metadata"
NETWORK_ALPHA = "alpha"
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
"""The file diffusers' `save_lora_weights` writes into a folder; a folder holding it is accepted."""


@dataclass(frozen=True)
class Pair:
    """One checked pair of an adapter on one of h3's linears."""

    keys: PairKeys
    rank: int
    in_features: int
    scale: float
    """The adapter's own `alpha / rank` (module docstring), before the user's scale."""

    @property
    def target(self) -> str:
        return self.keys.target


@dataclass
class AdapterFile:
    """An adapter checked against a model (`open_adapter`)."""

    path: Path
    name: str
    format: Format
    pairs: list[Pair]
    metadata: dict[str, str]
    schedule: AdapterSchedule
    size_bytes: int
    head_dim: int
    """The model's head width (a per-head interleaved qkv B is stacked with it)."""
    stored_dtypes: set[str] = field(default_factory=set)

    @property
    def targets(self) -> list[str]:
        """h3's linears it adapts, in order."""
        return sorted({p.target for p in self.pairs})

    @property
    def ranks(self) -> list[int]:
        return sorted({p.rank for p in self.pairs})

    def read_pair(self, reader: SafetensorsReader, pair: Pair) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [rank, in], B [len(rows), rank]) of `pair`, as stored (dtype), B in h3's row order."""
        down, up = reader.get(pair.keys.down), reader.get(pair.keys.up)
        return down, _h3_rows(up, pair.keys.order, self.head_dim)

    def open(self) -> SafetensorsReader:
        return SafetensorsReader([self.path])


def adapter_file(path: Path | str) -> Path:
    """The safetensors file of a `--lora` path: the file, or diffusers' `pytorch_lora_weights.safetensors`
    in a folder; anything else is one line."""
    path = Path(path)
    if path.is_dir():
        inside = path / DIFFUSERS_FILE
        if inside.is_file():
            return inside
        raise AdapterError(f"LoRA folder {path} holds no {DIFFUSERS_FILE}; give the adapter's .safetensors file")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise AdapterError(f"LoRA file {path} {'does not exist' if path_kind(path) == 'nothing' else 'cannot be read'}; check the --lora path") from None
    if not stat.S_ISREG(mode):
        raise AdapterError(f"LoRA path {path} is {path_kind(path, follow=True)}, not a file")
    return path


def open_adapter(path: Path | str, config: ModelConfig, *, check_values: bool = True) -> AdapterFile:
    """The adapter at `path` checked against a model of `config` (module docstring). Its header and
    scalars are host values: read for real also inside a fake-tensor mode (the dry run)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _open(path, config, check_values)


def _open(path: Path | str, config: ModelConfig, check_values: bool) -> AdapterFile:
    file = adapter_file(path)
    what = f"LoRA {file.name}"
    try:
        reader = SafetensorsReader([file])
    except CheckpointError as err:
        raise AdapterError(f"{what}: {err}") from None
    with reader:
        linears, full = model_linears(config)
        keymap = map_keys(reader.keys(), linears, full_linears=full, what=what)
        metadata = reader.metadata
        pairs = [_checked_pair(reader, keys, linears, config, what) for keys in keymap.pairs]
        pairs = _with_scales(pairs, reader, keymap, metadata, what)
        if check_values:
            _check_finite(reader, pairs, what)
        dtypes = {reader.dtype_name(k) for p in pairs for k in (p.keys.down, p.keys.up)}
    adapter = AdapterFile(path=file, name=file.stem, format=keymap.format, pairs=pairs, metadata=metadata,
                          schedule=read_schedule(metadata, what), size_bytes=file.stat().st_size, head_dim=config.head_dim,
                          stored_dtypes=dtypes)
    return adapter


def sha256_of(path: Path) -> str:
    """sha256 of the whole file (what a report records of each adapter)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# --- the model's linears -----------------------------------------------------------------------------------


def model_linears(config: ModelConfig) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """{name: (out, in)} of every linear of a model of `config`, and (for a pruned config) the full
    variant's names, so that an adapter for the full model is told what pruning removed."""
    linears = {name: (slot.out_features, slot.in_features) for name, slot in _slots(config)}
    full = [name for name, _ in _slots(config.model_copy(update={"pruned": False}))] if config.pruned else []
    return linears, full


def _slots(config: ModelConfig) -> list[tuple[str, DenseLinear]]:
    """Every linear slot of a model of `config` built on the meta device (as the loader's `linear_slots`)."""
    from h3core.model.dit import H3Model

    return [(name, m) for name, m in H3Model(config).named_modules() if isinstance(m, DenseLinear)]


# --- checks ------------------------------------------------------------------------------------------------


def _checked_pair(reader: SafetensorsReader, keys: PairKeys, linears: dict[str, tuple[int, int]], config: ModelConfig, what: str) -> Pair:
    down, up = reader.shape(keys.down), reader.shape(keys.up)
    for key, shape in ((keys.down, down), (keys.up, up)):
        if reader.dtype_name(key) not in FLOAT_DTYPE_NAMES:
            raise AdapterError(f"{what}: {key} is {reader.dtype_name(key)}; LoRA matrices are float (F16, BF16, F32)")
        if len(shape) != 2 or not all(shape):
            raise AdapterError(f"{what}: {key} has shape {list(shape)}; a LoRA matrix is 2-D and not empty")
    rank, in_features = down
    wanted = linears[keys.target][1]
    if in_features != wanted:
        raise AdapterError(_width_problem(keys, in_features, wanted, config, what))
    if up[1] != rank:
        raise AdapterError(f"{what}: rank mismatch on {keys.module}: lora_A/lora_down has rank {rank} but lora_B/lora_up {up[1]} "
                           f"({keys.down} {list(down)}, {keys.up} {list(up)}); the file is damaged")
    if rank > min(in_features, len(keys.rows)):
        raise AdapterError(f"{what}: {keys.module} has rank {rank}, more than its {in_features} inputs or {len(keys.rows)} outputs: "
                           "that is no low-rank pair (a full weight difference is smaller); the file is damaged")
    if up[0] != len(keys.rows):
        raise AdapterError(f"{what}: {keys.up} has {up[0]} rows but {keys.target} needs {len(keys.rows)} there "
                           f"(its output is {linears[keys.target][0]} wide); an adapter for another model size")
    if keys.order is RowOrder.INTERLEAVED and len(keys.rows) % (3 * config.head_dim):
        raise AdapterError(f"{what}: {keys.up} has {up[0]} rows, not a per-head interleaved qkv of {config.head_dim}-wide heads")
    return Pair(keys=keys, rank=rank, in_features=in_features, scale=1.0)


def _width_problem(keys: PairKeys, got: int, want: int, config: ModelConfig, what: str) -> str:
    if config.pruned and keys.target.endswith("adaln_proj.linear"):
        return (f"{what}: it targets {keys.target} with {got} input features, the full model's AdaLN projection; this checkpoint is "
                f"AdaLN-pruned: its projections read the rank-{want} curve of adaln_t_table, which the adapter was not trained on. "
                "Use the full checkpoint, or an adapter trained on the pruned one")
    return f"{what}: {keys.down} takes {got} input features but {keys.target} has {want}; an adapter for another model size"


def _check_finite(reader: SafetensorsReader, pairs: list[Pair], what: str) -> None:
    for pair in pairs:
        for key in (pair.keys.down, pair.keys.up, pair.keys.alpha):
            if key is not None and not bool(torch.isfinite(reader.get(key)).all()):
                raise AdapterError(f"{what}: {key} holds NaN or infinite values; the adapter is damaged (or was saved from a diverged run)")


# --- scales ------------------------------------------------------------------------------------------------


def _with_scales(pairs: list[Pair], reader: SafetensorsReader, keymap: KeyMap, metadata: dict[str, str], what: str) -> list[Pair]:
    """Each pair with its own scale (module docstring), a finite number within ±`MAX_SCALE`."""
    scaled = _alpha_scales(pairs, reader, keymap, metadata, what)
    for pair in scaled:
        if not math.isfinite(pair.scale) or abs(pair.scale) > MAX_SCALE:
            raise AdapterError(f"{what}: {pair.keys.module} has alpha / rank = {pair.scale:.4g} (rank {pair.rank}), outside ±{MAX_SCALE:g}; "
                               "its alpha is damaged (an adapter's own scale is about 1)")
    return scaled


def _alpha_scales(pairs: list[Pair], reader: SafetensorsReader, keymap: KeyMap, metadata: dict[str, str], what: str) -> list[Pair]:
    if any(p.keys.alpha is not None for p in pairs):
        return [_scaled(p, _alpha_tensor(reader, p, what) if p.keys.alpha else float(p.rank)) for p in pairs]
    if PEFT_METADATA in metadata:
        config = _peft_config(metadata[PEFT_METADATA], what)
        return [_peft_scaled(p, config, what) for p in pairs]
    if NETWORK_ALPHA in metadata:
        try:
            alpha = float(metadata[NETWORK_ALPHA])
        except ValueError:
            raise AdapterError(f"{what}: its __metadata__ alpha {metadata[NETWORK_ALPHA]!r} is not a number") from None
        if not math.isfinite(alpha):
            raise AdapterError(f"{what}: its __metadata__ alpha {metadata[NETWORK_ALPHA]!r} is not a finite number")
        return [_scaled(p, alpha) for p in pairs]
    return pairs  # alpha == rank: scale 1


def _scaled(pair: Pair, alpha: float, root: bool = False) -> Pair:
    return Pair(keys=pair.keys, rank=pair.rank, in_features=pair.in_features, scale=alpha / (math.sqrt(pair.rank) if root else pair.rank))


def _alpha_tensor(reader: SafetensorsReader, pair: Pair, what: str) -> float:
    key = pair.keys.alpha
    assert key is not None
    if reader.dtype_name(key) not in FLOAT_DTYPE_NAMES + ("I64", "I32") or int(torch.tensor(reader.shape(key)).prod()) != 1:
        raise AdapterError(f"{what}: {key} must be one number, got {reader.dtype_name(key)} {list(reader.shape(key))}")
    value = float(reader.get(key).reshape(()).item())
    if not math.isfinite(value):
        raise AdapterError(f"{what}: {key} is {value}, not a finite number; the adapter is damaged")
    return value


def _peft_config(text: str, what: str) -> dict:
    """The peft LoraConfig fields of diffusers' metadata, without its component prefix (`transformer.`):
    read by h3's one JSON reader (bounded in depth and numbers), its numbers and patterns checked."""
    raw = parse_json(text, f"{what}: its __metadata__ {PEFT_METADATA}", "the file is damaged: save the adapter again",
                     error=AdapterError, want=dict)
    if any(k.startswith("transformer_ref.") for k in raw):
        raise AdapterError(f"{what}: its metadata describes diffusers' transformer_ref (Ref2VA) partition; h3 runs the FL2VA transformer")
    config = {k.removeprefix("transformer."): v for k, v in raw.items()}
    if config.get("use_dora"):
        raise AdapterError(f"{what}: DoRA adapters (use_dora in its peft config) are not supported; h3 applies plain LoRA pairs")
    for name in ("r", "lora_alpha"):
        if not _is_number(config.get(name)):
            raise AdapterError(f"{what}: its peft config (__metadata__ {PEFT_METADATA}) has no finite numeric {name!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        _check_patterns(config.get(name), f"{what}: its peft config's {name}")
    return config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_PATTERN_CHARS = 1000
"""The longest peft `rank_pattern` / `alpha_pattern` key read (a module name or a short regex)."""

QUANTIFIED_GROUP = re.compile(r"\)(?:[*+?]|\{\d)")
"""A group with a quantifier, `(a+)+` or `(a|b){9}`: where Python's backtracking regex engine can take
exponential time (it has no timeout). peft's patterns are module names, with `.*` at most."""


def _check_patterns(patterns: object, where: str) -> None:
    """peft's per-module overrides: an object of regex -> a finite number, each regex one Python compiles."""
    if patterns is None:
        return
    if not isinstance(patterns, dict):
        raise AdapterError(f"{where} is a JSON {type(patterns).__name__}, not an object of module pattern -> number; the file is damaged")
    for pattern, value in patterns.items():
        if not _is_number(value):
            raise AdapterError(f"{where}[{pattern[:80]!r}] is {str(value)[:40]!r}, not a finite number; the file is damaged")
        try:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise re.error(f"longer than {MAX_PATTERN_CHARS} characters")
            if QUANTIFIED_GROUP.search(pattern):
                raise re.error("a repeated group, which can take exponential time to match")
            re.compile(pattern)
        except re.error as err:
            raise AdapterError(f"{where} key {pattern[:80]!r} is not a regular expression h3 reads ({err}); the file is damaged") from None


def _pattern(patterns: object, module: str) -> object | None:
    """peft's per-module override: the first pattern `p` with `re.match(rf'(.*\\.)?({p})$', module)`."""
    if not isinstance(patterns, dict):
        return None
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return None


def _peft_scaled(pair: Pair, config: dict, what: str) -> Pair:
    module = pair.keys.module
    rank = _pattern(config.get("rank_pattern"), module) or config["r"]
    alpha = _pattern(config.get("alpha_pattern"), module) or config["lora_alpha"]
    if rank != pair.rank:
        raise AdapterError(f"{what}: rank mismatch on {module}: its peft config says rank {rank}, its matrices have rank {pair.rank}")
    return _scaled(pair, float(alpha), root=bool(config.get("use_rslora")))


# --- row order ---------------------------------------------------------------------------------------------


def _h3_rows(up: torch.Tensor, order: RowOrder, head_dim: int) -> torch.Tensor:
    """B [rows, rank] reordered from the file's row order to h3's (keys.RowOrder)."""
    if order is RowOrder.SWAPPED:
        upper, gate = up.chunk(2)
        return torch.cat([gate, upper])
    if order is RowOrder.INTERLEAVED:
        heads = up.shape[0] // (3 * head_dim)
        return up.view(heads, 3, head_dim, up.shape[1]).transpose(0, 1).reshape(up.shape)
    return up
