"""Which linear of h3's model each tensor of a LoRA file belongs to, in every format h3 reads.

The format is detected from the key names, never from the file name (../shared/MINIMAX_H3.md §7b;
diffusers 0.42.1 `loaders/lora_conversion_utils._convert_non_diffusers_minimax_h3_lora_to_diffusers`
and `loaders/lora_pipeline.MiniMaxH3LoraLoaderMixin.lora_state_dict`, ComfyUI `comfy/lora.py`'s
MiniMaxH3 key map; the tables here are ours):

| format | module names | pair | written by |
|---|---|---|---|
| `peft` | diffusers' (`transformer_blocks.N.attn.to_q`, `ff.net.0.proj`, ...), under `transformer.` or bare with peft's `.default.` infix | `lora_A` / `lora_B` | diffusers `save_lora_weights`, peft |
| `kohya` | the original/Comfy names (`blocks.N.attn.qkv_proj`, `mlp.fc1`, ...), bare, under `diffusion_model.` / `model.diffusion_model.`, or flattened under `lora_unet_` | `lora_down` / `lora_up` (+ `alpha`) | ComfyUI, kohya, musubi-tuner |
| `original-peft` | the original names | `lora_A` / `lora_B` (+ `alpha`); with `.default.` (DiffSynth-Studio) the fused qkv rows are per-head interleaved | ai-toolkit, DiffSynth-Studio |

h3's model uses the original names with two row orders fixed (h3core.checkpoints.names): `qkv_proj`
stacked `[q; k; v]` and `fc1` `[gate; up]`. So an original name is h3's own linear; a diffusers
`to_q` / `to_k` / `to_v` pair covers one third of h3's `qkv_proj` rows, and `ff.net.0.proj`'s
`lora_B` rows are `[up; gate]`: the halves swap (`RowOrder.SWAPPED`). A pair's `lora_A` is never
reordered (the reorders permute output rows only).

Kinds that are no low-rank branch (LoHa, LoKr, DoRA, OFT, full weight differences, a bias on B) and
keys of another model are refused here, with the key that shows it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Iterable

from h3core.checkpoints.names import from_diffusers
from h3core.errors import AdapterError
from h3core.span import Span


class Format(str, Enum):
    """How an adapter file names its tensors (module docstring)."""

    PEFT = "peft"
    KOHYA = "kohya"
    ORIGINAL_PEFT = "original-peft"


class RowOrder(str, Enum):
    """How a pair's stored `lora_B` rows map onto h3's rows of its linear."""

    STORED = "stored"
    """Row for row (h3's stacked qkv, [gate; up] fc1, every other linear)."""
    SWAPPED = "swapped"
    """diffusers' `ff.net.0.proj` `[up; gate]`: the two halves trade places."""
    INTERLEAVED = "interleaved"
    """The official checkpoint's per-head `[q_h; k_h; v_h]` qkv rows (DiffSynth-Studio trains on them)."""


@dataclass(frozen=True)
class PairKeys:
    """One low-rank pair of a file, mapped onto one of h3's linears."""

    module: str
    """The module as the file names it (for messages)."""
    target: str
    """h3's linear (original names), e.g. `blocks.3.attn.qkv_proj`."""
    down: str
    """File key of A (`lora_A` / `lora_down`): [rank, in]."""
    up: str
    """File key of B (`lora_B` / `lora_up`): [len(rows), rank] in `order`."""
    alpha: str | None
    """File key of the kohya alpha scalar, if the file has one for this module."""
    rows: Span
    """The output rows of `target` that B's rows are (h3's row order)."""
    order: RowOrder


@dataclass(frozen=True)
class KeyMap:
    """Every pair of an adapter file, and what the file's names say about it."""

    format: Format
    pairs: list[PairKeys]
    prefixes: list[str]
    """The prefixes the keys carried (e.g. `transformer.`), as found."""


UNSUPPORTED: tuple[tuple[str, str], ...] = (
    (r"\.hada_(w[12]_[ab]|t[12])$", "LoHa (LyCORIS Hadamard product)"),
    (r"\.lokr_(w[12](_[ab])?|t2)$", "LoKr (LyCORIS Kronecker product)"),
    (r"\.dora_scale$", "DoRA (weight-decomposed LoRA)"),
    (r"\.lora_magnitude_vector(\.default)?(\.weight)?$", "DoRA (peft's lora_magnitude_vector)"),
    (r"\.(oft_blocks|oft_diag|boft_\w+)$", "OFT (orthogonal fine-tuning)"),
    (r"\.a[12]\.weight$", "GLoRA"),
    (r"\.lora_mid\.weight$", "LoCon with a mid (Tucker) tensor"),
    (r"\.(diff|diff_b)$", "a full weight difference"),
    (r"\.set_weight$", "a replaced weight"),
    (r"\.(w_norm|b_norm)$", "a norm difference"),
    (r"\.(lora_B|lora_up)\.bias$", "a bias on B (peft lora_bias)"),
)
"""Key endings that mark an adapter kind h3 does not apply, and its name. A LoRA is a low-rank branch
`s * B(A x)` beside the linear; these change the weight in ways no such branch computes."""

_ROLES: tuple[tuple[str, str, str], ...] = (
    # (suffix, role, pair style)
    (".lora_A.default.weight", "down", "A/B+default"),
    (".lora_B.default.weight", "up", "A/B+default"),
    (".lora_A.weight", "down", "A/B"),
    (".lora_B.weight", "up", "A/B"),
    (".lora_down.weight", "down", "down/up"),
    (".lora_up.weight", "up", "down/up"),
    (".alpha", "alpha", ""),
)

PARTITION_REF = "transformer_ref."
"""diffusers' prefix of the Ref2VA partition (`MiniMaxH3LoraLoaderMixin.transformer_ref_name`)."""

_PREFIXES = ("transformer.", "base_model.model.", "model.diffusion_model.", "diffusion_model.")
_FLAT = "lora_unet_"
_TO_QKV = re.compile(r"^(.*)\.attn\.to_([qkv])$")


def map_keys(keys: Iterable[str], linears: dict[str, tuple[int, int]], *, full_linears: Iterable[str] = (), what: str) -> KeyMap:
    """The pairs of an adapter with tensor names `keys` on a model whose linears are `linears`
    (name -> (out, in)); `full_linears`: the unpruned model's names (to say that a pruned checkpoint
    removed a target); `what`: the file, for messages. Raises `AdapterError` for a kind h3 does not
    apply, keys of another model, a partial match, a missing half of a pair or mixed formats."""
    keys = sorted(keys)
    _refuse_unsupported(keys, what)
    if any(k.startswith(PARTITION_REF) for k in keys):
        raise AdapterError(f"{what}: its keys are under {PARTITION_REF!r}, diffusers' Ref2VA partition; h3 runs the FL2VA transformer "
                           "(an adapter for it is under 'transformer.', 'diffusion_model.' or no prefix)")
    flat = {name.replace(".", "_"): name for name in (*linears, *full_linears)}
    parsed, unmatched, prefixes = {}, [], set()
    for key in keys:
        entry = _parse(key, flat)
        if entry is None:
            unmatched.append(key)
            continue
        parsed[key] = entry
        prefixes.add(entry.prefix)
    known = set(linears) | set(full_linears)
    resolved = {k: (e, _target(e.module, known)) for k, e in parsed.items()}
    unmatched += [k for k, (_, target) in resolved.items() if target is None]
    _refuse_unmatched(keys, unmatched, what)
    removed = sorted({t[0] for _, t in resolved.values() if t is not None and t[0] not in linears})
    if removed:
        raise AdapterError(f"{what}: it targets {removed[0]}, which this AdaLN-pruned checkpoint does not have (its timestep MLP is folded "
                           "into adaln_t_table); the adapter was trained on the full model: use the full checkpoint")
    return _pairs(resolved, linears, prefixes=sorted(prefixes), what=what)


@dataclass(frozen=True)
class _Key:
    prefix: str
    module: str
    role: str
    style: str


def _parse(key: str, flat: dict[str, str]) -> _Key | None:
    """A key's prefix, module name (dots restored for `lora_unet_` keys), role and pair style; None
    where it is no LoRA tensor name h3 knows."""
    for suffix, role, style in _ROLES:
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            break
    else:
        return None
    prefix = next((p for p in _PREFIXES if module.startswith(p)), "")
    module = module[len(prefix):]
    if not prefix and module.startswith(_FLAT):
        prefix, module = _FLAT, flat.get(module[len(_FLAT):], "")
        if not module:
            return None
    return _Key(prefix, module, role, style)


def _target(module: str, known: set[str]) -> tuple[str, str, int | None] | None:
    """(h3 linear, naming 'original' | 'diffusers', qkv third or None) of a module name; None if no linear."""
    if module in known:
        return module, "original", None
    match = _TO_QKV.match(module)
    if match:
        base = from_diffusers(f"{match.group(1)}.attn.to_q.weight").removesuffix(".weight")
        return (base, "diffusers", "qkv".index(match.group(2))) if base in known else None
    mapped = from_diffusers(f"{module}.weight").removesuffix(".weight")
    return (mapped, "diffusers", None) if mapped != module and mapped in known else None


def _refuse_unsupported(keys: list[str], what: str) -> None:
    for key in keys:
        for mark, kind in UNSUPPORTED:
            if re.search(mark, key):
                raise AdapterError(f"{what}: it holds {kind} (key {key!r}), which h3 does not apply; h3 applies LoRA pairs "
                                   "(lora_A/lora_B or lora_down/lora_up) as a low-rank branch beside each linear")


def _refuse_unmatched(keys: list[str], unmatched: list[str], what: str) -> None:
    if not unmatched:
        return
    if len(unmatched) == len(keys):
        raise AdapterError(f"{what}: no key names a linear of the MiniMax-H3 transformer (e.g. {_first_keys(keys)}); it is not an H3 LoRA "
                           "(an adapter for another model, or a format h3 does not know)")
    raise AdapterError(f"{what}: {len(unmatched)} of its {len(keys)} keys match no linear of this MiniMax-H3 transformer, the first "
                       f"{_first_keys(unmatched)}; h3 refuses a partially matching adapter (a LoRA for another model version, or a damaged file)")


SHOWN_KEYS, SHOWN_KEY_CHARS = 3, 120
"""How many keys a refusal names, and how much of each (a hostile key can be megabytes long)."""


def _first_keys(keys: list[str]) -> str:
    shown = [repr(k if len(k) <= SHOWN_KEY_CHARS else k[:SHOWN_KEY_CHARS] + "...") for k in keys[:SHOWN_KEYS]]
    return ", ".join(shown) + (f" (and {len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")


def _pairs(resolved: dict, linears: dict[str, tuple[int, int]], *, prefixes: list[str], what: str) -> KeyMap:
    modules: dict[str, dict[str, str]] = defaultdict(dict)
    targets: dict[str, tuple[str, str, int | None]] = {}
    styles, namings = set(), set()
    for key, (entry, target) in resolved.items():
        if entry.role in modules[entry.module]:
            raise AdapterError(f"{what}: two keys give the {entry.role} of {entry.module} ({modules[entry.module][entry.role]!r}, {key!r})")
        modules[entry.module][entry.role] = key
        targets[entry.module] = target
        if entry.style:
            styles.add(entry.style)
        namings.add(target[1])
    if len(namings) > 1:
        raise AdapterError(f"{what}: it mixes diffusers module names and the original names; h3 reads one format per file")
    if len({s.split("+")[0] for s in styles}) > 1:
        raise AdapterError(f"{what}: it mixes lora_A/lora_B and lora_down/lora_up pairs; h3 reads one format per file")
    naming = namings.pop()
    interleaved = naming == "original" and "A/B+default" in styles  # DiffSynth-Studio: the raw per-head qkv rows
    pairs = [_pair(module, roles, targets[module], linears, interleaved, what) for module, roles in sorted(modules.items())]
    _refuse_overlaps(pairs, what)
    fmt = Format.PEFT if naming == "diffusers" else Format.KOHYA if "down/up" in styles else Format.ORIGINAL_PEFT
    return KeyMap(fmt, pairs, prefixes)


def _pair(module: str, roles: dict[str, str], target: tuple[str, str, int | None], linears: dict[str, tuple[int, int]],
          interleaved: bool, what: str) -> PairKeys:
    for need, other in (("down", "up"), ("up", "down")):
        if need not in roles:
            have = roles.get(other) or roles["alpha"]
            raise AdapterError(f"{what}: {module} has {have!r} but no {'lora_A/lora_down' if need == 'down' else 'lora_B/lora_up'} "
                               "matrix; the file is incomplete")
    name, naming, third = target
    out = linears[name][0]
    if third is not None:
        width = out // 3
        rows, order = Span(third * width, (third + 1) * width), RowOrder.STORED
    elif naming == "diffusers" and name.endswith(".mlp.fc1"):
        rows, order = Span(0, out), RowOrder.SWAPPED
    elif interleaved and name.endswith(".attn.qkv_proj"):
        rows, order = Span(0, out), RowOrder.INTERLEAVED
    else:
        rows, order = Span(0, out), RowOrder.STORED
    return PairKeys(module=module, target=name, down=roles["down"], up=roles["up"], alpha=roles.get("alpha"), rows=rows, order=order)


def _refuse_overlaps(pairs: list[PairKeys], what: str) -> None:
    seen: dict[str, list[PairKeys]] = defaultdict(list)
    for pair in pairs:
        for other in seen[pair.target]:
            if pair.rows.overlap(other.rows):
                raise AdapterError(f"{what}: {other.module} and {pair.module} both adapt rows {pair.rows} of {pair.target}; "
                                   "the file holds one adapter written twice")
        seen[pair.target].append(pair)
