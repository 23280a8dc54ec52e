"""What `h3 matrix` runs: rank counts, modes and the request every cell shares (flag > variable > default)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from h3core import settings
from h3core.generate.request import GenerateRequest
from h3core.errors import ConfigError, LayoutError
from h3core.parallel.layout import CFG_NEEDS_GUIDANCE
from h3core.parallel.modes import Mode
from h3core.reports.outputs import default_folder
from h3core.runtime import device as dev

DEFAULT_COUNTS = (1, 2, 4, 6, 8)  # the seed's matrix
DEFAULT_MODES = tuple(Mode)  # every registered mode
DEFAULT_REPEAT = 3


class MatrixRequest(BaseModel):
    """What `h3 matrix` runs, fully resolved (no environment lookups after `build`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    counts: list[int] = Field(description="Rank counts asked for, ascending; the 1-rank baseline runs even when 1 is not among them.")
    modes: list[Mode] = Field(description="Distributed modes, in the order they run.")
    cfg_parallel: bool = Field(False, description="Also run each mode with CFG parallel at every requested even count (needs guidance).")
    template: GenerateRequest = Field(description="Settings every cell shares; each cell sets its own mode and world_size.")
    save_latents: bool = Field(description="Write each cell's latents.safetensors (H3_SAVE_LATENTS=0: reports only).")
    output: Path = Field(description="Folder of matrix.json/.md/.png and one subfolder per cell.")
    benchmark: Path | None = Field(None, description="Also write the matrix JSON here (H3_DISTRIBUTED_BENCHMARK).")
    overwrite: bool = Field(False, description="Replace an existing folder of h3 results at `output` whole.")
    repeat: int = Field(DEFAULT_REPEAT, ge=1, description="Times each cell runs, in rounds interleaved across the cells (h3core.bench.alternate.rounds); its step time is the median, with the spread.")

    @classmethod
    def build(
        cls,
        template: GenerateRequest,
        *,
        counts: str | None = None,
        modes: str | None = None,
        save_latents: bool | None = None,
        output: Path | None = None,
        benchmark: Path | None = None,
        overwrite: bool = False,
        cfg_parallel: bool = False,
        repeat: int = 3,
    ) -> "MatrixRequest":
        """Apply flag > variable > default (`h3core.settings`) to every setting; resolve the template's
        device and its checkpoint and text encoder paths (H3_MODEL_PATH, H3_TEXT_ENCODER_PATH)."""
        if cfg_parallel and template.guidance_scale == 1.0:
            raise LayoutError(CFG_NEEDS_GUIDANCE)
        if repeat < 1:
            raise ConfigError(f"--repeat {repeat}: must be at least 1 (times each cell runs)")
        names = settings.mode_names(modes, [m.value for m in Mode], [m.value for m in DEFAULT_MODES])
        template = template.model_copy(update={
            "device": dev.resolve_device(template.device), "world_size": 1,
            "model_path": settings.model_path(template.model_path), "text_encoder_path": settings.text_encoder_path(template.text_encoder_path),
        })
        return cls(
            overwrite=overwrite, cfg_parallel=cfg_parallel, repeat=repeat,
            counts=settings.rank_counts(counts, DEFAULT_COUNTS),
            modes=[Mode(name) for name in names],
            template=template,
            save_latents=settings.save_latents(save_latents),
            output=settings.output_folder(output) or default_folder("matrix"),
            benchmark=settings.benchmark_path(benchmark),
        )
