"""The sampling schedule an adapter asks for in its safetensors `__metadata__`, and how a run takes it.

A distilled few-step adapter is trained for one schedule (a number of sigma points and a flow shift,
or an explicit sigma list); h3 reads it from these metadata keys, all optional, all strings (as
safetensors metadata is):

| key | value | h3 flag it stands for |
|---|---|---|
| `h3.steps` | an integer >= 2: sigma points of both schedules, terminal 0 included (`steps - 1` forwards) | `--steps` |
| `h3.video_shift` | a float > 0: flow shift of the video schedule | `--video-shift` |
| `h3.audio_shift` | a float > 0: flow shift of the audio schedule | `--audio-shift` |
| `h3.video_sigmas` | a JSON list of floats, strictly decreasing from <= 1 to exactly 0: the video schedule itself | (overrides steps and the video shift) |
| `h3.audio_sigmas` | the same for audio (as long as `h3.video_sigmas`) | (overrides the audio shift) |

No public MiniMax-H3 adapter we found ships any of these (docs/lora.md says what their model cards
ask for instead); the keys are h3's, so that a converted or self-trained adapter carries its own
schedule. `merge_schedules` combines the adapters of a run (two that disagree are refused) and
`RunShape.of` applies the result where the user gave no value of their own; a user's value that
contradicts the adapter's is refused, naming both.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from h3core.errors import AdapterError
from h3core.files.text import parse_json

STEPS = "h3.steps"
VIDEO_SHIFT = "h3.video_shift"
AUDIO_SHIFT = "h3.audio_shift"
VIDEO_SIGMAS = "h3.video_sigmas"
AUDIO_SIGMAS = "h3.audio_sigmas"
KEYS = (STEPS, VIDEO_SHIFT, AUDIO_SHIFT, VIDEO_SIGMAS, AUDIO_SIGMAS)


class AdapterSchedule(BaseModel):
    """What an adapter's metadata fixes of the sampler (None: it leaves that to the run)."""

    model_config = ConfigDict(frozen=True)
    steps: int | None = Field(None, ge=2, description="Sigma points, terminal 0 included.")
    video_shift: float | None = Field(None, gt=0)
    audio_shift: float | None = Field(None, gt=0)
    video_sigmas: list[float] | None = Field(None, description="The video schedule itself (1 -> 0), when given.")
    audio_sigmas: list[float] | None = Field(None, description="The audio schedule itself, when given.")
    source: str = Field("", description="The adapter(s) it came from.")

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in ("steps", "video_shift", "audio_shift", "video_sigmas", "audio_sigmas"))

    @property
    def points(self) -> int | None:
        """Sigma points it fixes: the sigma list's length, else `steps`."""
        return len(self.video_sigmas) if self.video_sigmas is not None else self.steps


def read_schedule(metadata: dict[str, str], what: str) -> AdapterSchedule:
    """The schedule of an adapter's `__metadata__` (module docstring); a malformed value is one line."""
    fields: dict[str, object] = {}
    if STEPS in metadata:
        fields["steps"] = _number(metadata, STEPS, int, what, low=2)
    for key, field in ((VIDEO_SHIFT, "video_shift"), (AUDIO_SHIFT, "audio_shift")):
        if key in metadata:
            fields[field] = _number(metadata, key, float, what, low=0.0, strict=True)
    for key, field in ((VIDEO_SIGMAS, "video_sigmas"), (AUDIO_SIGMAS, "audio_sigmas")):
        if key in metadata:
            fields[field] = _sigmas(metadata[key], key, what)
    schedule = AdapterSchedule(**fields, source=what)  # type: ignore[arg-type]
    _check_consistent(schedule, what)
    return schedule


def _number(metadata: dict[str, str], key: str, kind: type, what: str, low: float, strict: bool = False) -> float:
    text = metadata[key].strip()
    try:
        value = kind(text)
    except ValueError:
        raise AdapterError(f"{what}: metadata {key}={text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise AdapterError(f"{what}: metadata {key}={text!r} is out of range ({'>' if strict else '>='} {low:g})")
    return value


def _sigmas(text: str, key: str, what: str) -> list[float]:
    try:
        values = parse_json(text, what, "", error=AdapterError)  # bounded in depth and numbers (h3's one JSON reader)
    except AdapterError:
        values = None
    ok = isinstance(values, list) and len(values) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if ok:
        values = [float(v) for v in values]
        ok = all(math.isfinite(v) for v in values) and values[0] <= 1.0 and values[-1] == 0.0 and all(a > b for a, b in zip(values, values[1:]))
    if not ok:
        raise AdapterError(f"{what}: metadata {key} must be a JSON list of at least 2 numbers decreasing strictly from <= 1 to 0, got {text[:80]!r}")
    return values  # type: ignore[return-value]


def _check_consistent(s: AdapterSchedule, what: str) -> None:
    if s.video_sigmas is not None and s.steps is not None and s.steps != len(s.video_sigmas):
        raise AdapterError(f"{what}: metadata {STEPS}={s.steps} but {VIDEO_SIGMAS} has {len(s.video_sigmas)} points")
    if s.audio_sigmas is not None and (s.video_sigmas is None or len(s.audio_sigmas) != len(s.video_sigmas)):
        raise AdapterError(f"{what}: metadata {AUDIO_SIGMAS} needs {VIDEO_SIGMAS} of the same length (one forward serves both)")


def merge_schedules(schedules: list[AdapterSchedule]) -> AdapterSchedule:
    """One schedule from every adapter of a run: each field from whichever adapter sets it; two
    adapters that set one field differently are refused (which schedule would the run follow?)."""
    fields: dict[str, object] = {}
    origin: dict[str, str] = {}
    for s in schedules:
        for name in ("steps", "video_shift", "audio_shift", "video_sigmas", "audio_sigmas"):
            value = getattr(s, name)
            if value is None:
                continue
            if name in fields and fields[name] != value:
                raise AdapterError(f"the adapters disagree on the schedule: {origin[name]} asks for {name}={fields[name]}, {s.source} for "
                                   f"{name}={value}; load adapters trained for one schedule together")
            fields[name], origin[name] = value, s.source
    merged = AdapterSchedule(**fields, source=", ".join(sorted(set(origin.values()))))  # type: ignore[arg-type]
    _check_consistent(merged, merged.source)
    return merged
