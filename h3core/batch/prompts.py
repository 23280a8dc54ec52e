"""The prompt file of `h3 generate --prompts FILE`, read and checked whole before anything runs.

Two forms:

- text: one prompt per line; blank lines and lines starting with `#` are skipped;
- JSONL (a `.jsonl` file, or one whose first prompt line starts with `{`): one JSON object per
  line with `prompt` (required) and optionally `negative_prompt`, `seed`, `width`, `height`,
  `frames`, `steps`, `guidance`, `keyframes` (`{"first": PATH, "last": PATH}`, either or both;
  a relative path is relative to the prompt file's folder; `{}`: none, whatever the flags say),
  `name` (the output folder's name) and `loras` (a list of `{"path": ..., "scale": ...}`: this
  prompt's LoRA adapters instead of the `--lora` flags', `[]` for none; a relative path is
  relative to the prompt file's folder, as a keyframe's: the file means the same wherever it is run
  from; the ranks keep the base model and swap only the adapters between prompts); blank and `#`
  lines are skipped here too.

What a line leaves out comes from the flags. A malformed file is one `ConfigError` naming the file
and the line (exit 2), before any rank starts.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3core.errors import ConfigError
from h3core.files.text import BOM, parse_json, read_text
from h3core.generate.prompt import PromptText
from h3core.lora.spec import LoraScale

MAX_SEED = 2**64 - 1
MAX_FILE_BYTES = 64 << 20
"""The largest prompt file read (a regular file only): some 100,000 prompts of ordinary length."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class PromptLora(BaseModel):
    """One adapter of a JSONL line: `{"path": "turbo.safetensors", "scale": 0.8}` (scale default 1)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    path: str = Field(min_length=1)
    scale: LoraScale = 1.0


class PromptEntry(BaseModel):
    """One prompt of the file: what it sets (None: the flag's value)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    line: int = Field(description="Its line in the file (1-based).")
    prompt: PromptText
    negative_prompt: str | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    frames: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)
    guidance: float | None = Field(None, ge=0, allow_inf_nan=False)
    keyframes: dict[str, Path] | None = Field(None, description="FL2VA: {first, last} -> image file (relative paths already made relative to the prompt file's folder).")
    name: str | None = Field(None, pattern=NAME.pattern, description="The output folder's name after its number (default: a slug of the prompt).")
    loras: list[PromptLora] | None = Field(None, description="This prompt's LoRA adapters (None: the --lora flags'; []: none).")

    def overrides(self) -> dict[str, object]:
        """The `GenerateRequest` fields this prompt sets."""
        from h3core.lora.spec import LoraSpec

        loras = None if self.loras is None else tuple(LoraSpec(path=Path(a.path), scale=a.scale) for a in self.loras)
        fields = {"prompt": self.prompt, "negative_prompt": self.negative_prompt, "seed": self.seed, "width": self.width,
                  "height": self.height, "frames": self.frames, "steps": self.steps, "guidance_scale": self.guidance, "keyframes": self.keyframes,
                  "loras": loras}
        return {k: v for k, v in fields.items() if v is not None}


FIELDS = tuple(name for name in PromptEntry.model_fields if name != "line")


def read_prompts(path: Path) -> list[PromptEntry]:
    """Every prompt of `path`, in order; one ConfigError naming the file and line for anything wrong."""
    lines = _read_lines(path)
    content = [(n, text.strip()) for n, text in enumerate(lines, 1) if text.strip() and not text.strip().startswith("#")]
    if not content:
        raise ConfigError(f"--prompts {path}: no prompts in the file (blank lines and lines starting with # are skipped)")
    jsonl = path.suffix == ".jsonl" or content[0][1].startswith("{")
    return [_json_entry(path, n, text) if jsonl else PromptEntry(line=n, prompt=text) for n, text in content]


def _read_lines(path: Path) -> list[str]:
    """The file's lines: UTF-8, bounded in size, byte-order marks dropped (the file's, by
    `h3core.files.text`; a line's, left where files were joined with `cat`)."""
    text = read_text(path, "--prompts", MAX_FILE_BYTES, "give a UTF-8 prompt file (one prompt per line, or JSONL)")
    return [line.removeprefix(BOM) for line in text.splitlines()]


def _json_entry(path: Path, line: int, text: str) -> PromptEntry:
    where = f"--prompts {path}, line {line}"
    data = parse_json(text, where, 'each line of a JSONL file is one object, e.g. {"prompt": "a red fox", "seed": 1}', want=dict)
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; a prompt takes {', '.join(FIELDS)}")
    if "prompt" not in data:
        raise ConfigError(f"{where}: no \"prompt\" (it is the one required field)")
    if "keyframes" in data:
        data["keyframes"] = _keyframes(where, data["keyframes"], path.parent)
    try:
        entry = PromptEntry(line=line, **data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{where}: {field}: {first['msg']} (got {repr(first.get('input'))[:200]})") from None
    return _adapters_beside(entry, path.parent)


def _adapters_beside(entry: PromptEntry, folder: Path) -> PromptEntry:
    """A line's adapters with relative paths taken from the prompt file's `folder` (as its keyframes)."""
    if not entry.loras:
        return entry
    loras = [lora.model_copy(update={"path": str(folder / lora.path)}) for lora in entry.loras]
    return entry.model_copy(update={"loras": loras})


def _keyframes(where: str, value: object, folder: Path) -> dict[str, Path]:
    """A line's `"keyframes"`: an object of first/last -> a path string (relative: to the prompt file's folder)."""
    from h3core.keyframes import ROLES, KeyframeError

    if not isinstance(value, dict):
        raise KeyframeError(f'{where}: "keyframes" must be an object like {{"first": "start.png", "last": "end.png"}}, got {type(value).__name__}')
    out = {}
    for role, path in value.items():
        if role not in ROLES:
            raise KeyframeError(f'{where}: keyframe role {role!r} is not one of {", ".join(ROLES)}; say "first" and/or "last"')
        if not isinstance(path, str) or not path:
            raise KeyframeError(f'{where}: the {role} keyframe must be a path string, got {path!r}')
        out[role] = folder / path
    return out


def folder_names(entries: list[PromptEntry]) -> list[str]:
    """`NNN-<name or slug of the prompt>` per prompt: numbered in file order, so names never collide."""
    width = max(3, len(str(len(entries) - 1)))
    return [f"{i:0{width}d}-{entry.name or slug(entry.prompt)}" for i, entry in enumerate(entries)]


def slug(text: str, limit: int = 40) -> str:
    """Lowercase ASCII letters and digits joined by '-', at most `limit` characters ('prompt' if none)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    out = ""
    for word in words:
        candidate = f"{out}-{word}" if out else word
        if len(candidate) > limit:
            break
        out = candidate
    return out or (words[0][:limit] if words else "prompt")
