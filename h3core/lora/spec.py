"""What a request asks of adapters: `--lora PATH[:SCALE]` (repeatable), a JSONL line's `loras`, an API's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3core.errors import AdapterError

MAX_SCALE = 100.0
"""The largest strength (either sign) a request may give an adapter, and the largest `alpha / rank` an
adapter may carry: ComfyUI's bound on a LoRA strength. Past it a branch swamps the base weights (a
scale of 1e30 is inf in bf16, then every latent NaN), so a larger one is a typo or a damaged file."""

LoraScale = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-MAX_SCALE, le=MAX_SCALE,
                                   description=f"The user's strength, within ±{MAX_SCALE:g}; 1 applies the adapter as trained, 0 leaves the model as it is.")]
"""An adapter's strength wherever a request gives one (`--lora PATH:SCALE`, a JSONL line's and the
server's `loras`, the API): a number (not a boolean or a string), finite, within ±`MAX_SCALE`."""


class LoraSpec(BaseModel):
    """One adapter of a request: its file and the user's scale (the strength `s` of `y = W x + s B(A x)`,
    times the adapter's own `alpha / rank`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path = Field(description="The adapter's .safetensors file (or a folder holding diffusers' pytorch_lora_weights.safetensors).")
    scale: LoraScale = 1.0


def parse_lora(text: str) -> LoraSpec:
    """`PATH[:SCALE]` (the `--lora` flag): the text after the last ':' is the scale when it is a number
    (a finite one, else one line), or part of the path when the whole text names a file."""
    head, sep, tail = text.rpartition(":")
    if not sep or (Path(text).exists() and not Path(head).exists()):
        return LoraSpec(path=Path(text))
    try:
        scale = float(tail)
    except ValueError:
        raise AdapterError(f"--lora {text}: the scale {tail!r} after the last ':' is not a number (give PATH or PATH:SCALE, e.g. turbo.safetensors:0.8)") from None
    if not math.isfinite(scale):
        raise AdapterError(f"--lora {text}: the scale {tail!r} is not a finite number")
    if abs(scale) > MAX_SCALE:
        raise AdapterError(f"--lora {text}: the scale {tail!r} is outside ±{MAX_SCALE:g}; an adapter's strength is usually 0 to 2")
    return LoraSpec(path=Path(head), scale=scale)


def lora_spec(entry: "str | Path | tuple[str | Path, float] | LoraSpec") -> LoraSpec:
    """A `LoraSpec` from what an API caller passes: a path, `(path, scale)`, or a `LoraSpec`; a scale
    that is not a finite number is one `AdapterError` line."""
    if isinstance(entry, LoraSpec):
        return entry
    path, scale = (entry, 1.0) if isinstance(entry, (str, Path)) else entry
    try:
        return LoraSpec(path=Path(path), scale=scale)
    except ValidationError as err:
        raise AdapterError(f"LoRA {path}: scale {scale!r} is not a finite number within ±{MAX_SCALE:g} ({err.errors()[0]['msg']})") from None
