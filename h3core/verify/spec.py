"""What `h3 verify` was asked to do (`VerifyConfig`) and what every rank needs to do it (`VerifySpec`).

Torch-free: the CLI validates check names, counts, device and preset before anything heavy is
imported or any process is spawned.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from h3core import settings
from h3core.errors import ConfigError
from h3core.model.config import ModelConfig, VideoShape, preset as get_preset
from h3core.model.sequence import Segment
from h3core.parallel.modes import Mode
from h3core.parallel.plan import ParallelPlan
from h3core.settings import UserRequest

CHECK_NAMES = ("transport", "sdpa", "ragged", "projection", "tp", "nvfp4", "parity", "backends")
"""Every check, in the order they run and are printed."""

DEFAULT_COUNTS = (2, 4, 6, 8)
DEFAULT_STEPS = 2
VERIFY_SEED = settings.DEFAULT_SEED
VERIFY_PROMPT = "a fox in the snow"
"""17 bytes: with the synthetic byte-level text encoder the narrow preset's sequence is 17 text +
120 video + 10 audio = 147 tokens, which none of 2, 4, 6, 8 divides."""


def parse_checks(names: list[str]) -> list[str]:
    """Check names as given (none = all), deduplicated, in run order; an unknown one is a ConfigError."""
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown:
        raise ConfigError(f"unknown check {unknown[0]!r}; valid checks: {', '.join(CHECK_NAMES)}")
    return [n for n in CHECK_NAMES if n in names] if names else list(CHECK_NAMES)


class VerifyConfig(UserRequest):
    """One `h3 verify` request (an invalid value is one ConfigError line naming its flag)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    FLAGS: ClassVar[dict[str, str]] = {"checks": "CHECK"}

    checks: list[str] = Field(default_factory=lambda: list(CHECK_NAMES), description="Checks to run, in run order.")
    counts: list[int] = Field(default_factory=lambda: list(DEFAULT_COUNTS), description="Rank counts for the distributed checks.")
    device: str = Field("auto", description="auto, cpu or cuda.")
    preset: str = Field("narrow", description="Model preset whose shapes (and synthetic weights) every check uses.")
    steps: int = Field(DEFAULT_STEPS, ge=1, description="Denoising steps of the end-to-end parity runs.")
    seed: int = Field(VERIFY_SEED, ge=0, le=2**64 - 1, description="Seed of every random input and of the latent noise.")
    output: Path | None = Field(None, description="Report folder (default outputs/<time>-verify-<4 hex>).")
    overwrite: bool = Field(False, description="Replace an existing folder of h3 results at `output` whole.")

    @classmethod
    def from_flags(cls, *, counts: str, output: Path | None, **flags: object) -> "VerifyConfig":
        """The request of the command line: `--counts` parsed, `--output` else H3_DISTRIBUTED_OUTPUT."""
        return cls(counts=settings.parse_int_list(counts, "--counts"), output=settings.output_folder(output), **flags)  # type: ignore[arg-type]

    @field_validator("checks")
    @classmethod
    def _known_checks(cls, names: list[str]) -> list[str]:
        return parse_checks(names)

    @field_validator("counts")
    @classmethod
    def _positive_counts(cls, counts: list[int]) -> list[int]:
        if not counts or min(counts) < 1:
            raise ConfigError(f"--counts {counts} must hold rank counts of 1 or more, e.g. 2,4,6,8")
        return sorted(set(counts))

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        get_preset(name)
        return name


class VerifySpec(BaseModel):
    """Everything a rank needs for any check; sent to the ranks with each task."""

    model_config = ConfigDict(frozen=True)

    config: ModelConfig
    checkpoint: str = Field(description="The synthetic checkpoint of `config` (built before spawning).")
    device: str = Field(description="cpu or cuda.")
    dtype: str = Field(description="Compute dtype: fp32 on the CPU, bf16 on CUDA.")
    steps: int
    seed: int
    prompt: str = VERIFY_PROMPT

    @property
    def text_tokens(self) -> int:
        """The prompt's tokens with the synthetic text encoder's tokenizer (the checks' encoder)."""
        from h3core.text import check_text_encoder

        return len(check_text_encoder(None, hidden_size=self.config.text_dim).encode(self.prompt))

    @property
    def segments(self) -> list[Segment]:
        """The packed `text | audio | video` sequence every check uses (the preset's default video)."""
        cfg = self.config
        return cfg.segments(cfg.width, cfg.height, cfg.frames, self.text_tokens)

    @property
    def num_tokens(self) -> int:
        return self.segments[-1].stop

    @property
    def segment_sizes(self) -> dict[str, int]:
        return {seg.kind.value: len(seg) for seg in self.segments}

    def plan(self, world_size: int, mode: Mode) -> ParallelPlan:
        """The plan of the checks' sequence at `world_size` ranks in `mode` (built on the rank that needs it)."""
        return ParallelPlan.build(self.config, world_size, mode, self.segments)

    @property
    def shape(self) -> VideoShape:
        """The preset's default video (what every check's sequence holds)."""
        cfg = self.config
        return cfg.video_shape(cfg.width, cfg.height, cfg.frames)
