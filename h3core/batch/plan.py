"""Which prompts a batch runs: each prompt resolved on its own (an error is that prompt's, recorded,
not the batch's), and those whose results an earlier run of the same command completed skipped.

A result is complete when its folder holds a report.json whose `request_fingerprint` is that of the
prompt's resolved request now (a changed prompt, seed, size, mode or rank count is redone), and
its latents when they are saved. With `overwrite` every prompt runs again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from h3core.batch.prompts import PromptEntry, folder_names
from h3core.batch.report import PromptResult, PromptStatus
from h3core.errors import ConfigError, H3Error
from h3core.generate.report import request_fingerprint
from h3core.generate.request import GenerateRequest, ResolvedRun, resolve


class BatchJob(BaseModel):
    """One `h3 generate --prompts FILE` command: the flags (every prompt's defaults) and where results go."""

    model_config = ConfigDict(frozen=True)
    template: GenerateRequest = Field(description="The flags as a request: what a prompt of the file does not set.")
    prompts_file: Path
    output: Path | None = Field(None, description="The batch folder (None: outputs/<time>-batch-<mode>-<N>-<4 hex>).")
    save_latents: bool = True
    overwrite: bool = Field(False, description="Run every prompt again, also those an earlier run completed.")


@dataclass
class PlannedPrompt:
    """A prompt of the batch: its summary row, and its resolved run (None when resolving failed)."""

    result: PromptResult
    run: ResolvedRun | None


def plan_prompts(template: GenerateRequest, entries: list[PromptEntry]) -> list[PlannedPrompt]:
    """Resolve every prompt with the flags as defaults; a prompt that cannot run is marked failed."""
    return [_plan_one(template, entry, index, name) for index, (entry, name) in enumerate(zip(entries, folder_names(entries)))]


def _plan_one(template: GenerateRequest, entry: PromptEntry, index: int, name: str) -> PlannedPrompt:
    result = PromptResult(index=index, line=entry.line, prompt=entry.prompt, seed=entry.seed, folder=name)
    try:
        request = GenerateRequest(**{**template.model_dump(), **entry.overrides()})
        run = resolve(request)
    except H3Error as err:
        return PlannedPrompt(result.model_copy(update={"status": PromptStatus.FAILED, "error": str(err)}), None)
    s = run.shape
    size = f"{s.width}x{s.height}, {s.frames} frames, {s.steps} steps"
    update = {"seed": run.request.seed, "size": size, "fingerprint": request_fingerprint(run)}
    return PlannedPrompt(result.model_copy(update=update), run)


def mark_complete(planned: list[PlannedPrompt], folder: Path, save_latents: bool) -> None:
    """Mark skipped the prompts whose folder under `folder` already holds their complete result."""
    for p in planned:
        if p.run is not None and is_complete(folder / p.result.folder, p.result.fingerprint, save_latents):
            p.result.status, p.result.report = PromptStatus.SKIPPED, str(folder / p.result.folder / "report.json")


def is_complete(folder: Path, fingerprint: str | None, save_latents: bool) -> bool:
    """`folder` holds the report of the request with `fingerprint` (and its latents, when saved)."""
    try:
        written = json.loads((folder / "report.json").read_text()).get("request_fingerprint")
    except (OSError, ValueError, AttributeError):
        return False
    return written == fingerprint and (not save_latents or (folder / "latents.safetensors").is_file())


def to_run(planned: list[PlannedPrompt]) -> list[int]:
    """The indices of the prompts still to run, in file order."""
    return [p.result.index for p in planned if p.result.status is PromptStatus.PENDING]


def check_flags(template: GenerateRequest) -> None:
    """The flags alone (every prompt's defaults) must resolve: a bad flag is the command's error, not
    every prompt's (exit 2 before anything runs)."""
    try:
        resolve(template)
    except ConfigError as err:
        raise ConfigError(f"{err} (the flags, which every prompt of --prompts starts from)") from None
