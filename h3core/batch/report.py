"""The summary of `h3 generate --prompts` (batch.json): every prompt's status, time, load time and
folder, rewritten after every prompt so that it is current even after a crash."""

from __future__ import annotations

from enum import Enum
from typing import Callable

from pydantic import BaseModel, Field

from h3core.errors import CheckFailed
from h3core.parallel.modes import Mode
from h3core.reports.schema import Versions

REPORT_NAME = "batch.json"


class PromptStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"  # complete from an earlier run of the same command (same request fingerprint)
    PENDING = "pending"  # not run (yet): in a summary written while the batch runs, or after it stopped


class PromptResult(BaseModel):
    """One prompt of the batch: what was asked, what happened, where its results are."""

    index: int
    line: int = Field(description="Its line in the prompt file.")
    prompt: str
    seed: int | None = None
    size: str | None = Field(None, description="'WxH, F frames, S steps' as resolved (None when resolving failed).")
    folder: str = Field(description="Its output folder (NNN-<name or slug>), under the batch folder.")
    status: PromptStatus = PromptStatus.PENDING
    error: str | None = Field(None, description="The one-line error it failed with.")
    seconds: float | None = Field(None, description="Wall time of this prompt on the ranks (load, sampling, gather) and its files.")
    load_seconds: float | None = Field(None, description="Denoiser load this prompt paid: the first prompt of a World pays it, later ones 0.")
    sampling_seconds: float | None = None
    fingerprint: str | None = Field(None, description="sha256 of the resolved request (its report.json carries the same).")
    replica: int | None = Field(None, description="The replica group that ran it (`--replicas`; 0 with one group).")
    report: str | None = Field(None, description="Its report.json.")


class BatchReport(BaseModel):
    """Everything `h3 generate --prompts` did (batch.json)."""

    command: str = "generate --prompts"
    created: str
    updated: str
    complete: bool = Field(False, description="True once every prompt has run (or was skipped); False while running or after it stopped.")
    stopped: str | None = Field(None, description="Why the batch ended before its last prompt (Ctrl-C, the ranks could not start).")
    prompts_file: str
    mode: Mode
    world_size: int
    device: str
    directory: str
    resumed: bool = Field(False, description="The folder held an earlier run of this batch: prompts it completed were skipped.")
    text_encoder_seconds: float | None = Field(None, description="Loading and releasing the text encoder, once for the batch (rank 0).")
    loads: int = Field(0, description="Times the denoiser was loaded: 1, plus one after every prompt that failed on the ranks.")
    prompts: list[PromptResult]
    versions: Versions

    def count(self, status: PromptStatus) -> int:
        return sum(p.status is status for p in self.prompts)

    def failure(self) -> CheckFailed | None:
        """Exit 1 when a prompt failed (each is recorded with its error in batch.json)."""
        failed = [p for p in self.prompts if p.status is PromptStatus.FAILED]
        if not failed:
            return None
        first = failed[0]
        return CheckFailed(
            f"{len(failed)} of {len(self.prompts)} prompts failed (first: {first.folder}: {first.error}); "
            f"see {self.directory}/{REPORT_NAME}"
        )


class BatchProgress(BaseModel):
    """What the batch tells its caller's two progress bars: prompts done, and the current prompt's steps."""

    done: int
    total: int
    prompt: str = Field(description="The current prompt's folder name ('' when none runs).")
    step: int = 0
    steps: int = 0
    step_seconds: float | None = None


ProgressCallback = Callable[[BatchProgress], None]
