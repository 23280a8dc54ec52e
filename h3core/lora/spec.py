"""What a request asks of adapters: `--lora PATH[:SCALE]` (repeatable), a JSONL line's `loras`, an API's."""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3core.errors import AdapterError


class LoraSpec(BaseModel):
    """One adapter of a request: its file and the user's scale (the strength `s` of `y = W x + s B(A x)`,
    times the adapter's own `alpha / rank`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path = Field(description="The adapter's .safetensors file (or a folder holding diffusers' pytorch_lora_weights.safetensors).")
    scale: float = Field(1.0, allow_inf_nan=False, description="The user's strength; 1 applies the adapter as trained, 0 leaves the model as it is.")


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
        raise AdapterError(f"LoRA {path}: scale {scale!r} is not a finite number ({err.errors()[0]['msg']})") from None
