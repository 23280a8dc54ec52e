"""Which prompts a batch runs: each prompt resolved on its own (an error is that prompt's, recorded,
not the batch's), and those whose results an earlier run of the same batch completed skipped.

A batch is "the same batch" when its prompt file (by its resolved path) and its flags are
(`batch_fingerprint`, kept in batch.json): the folder of another batch is refused unless
`--overwrite`, which replaces it whole. Within the same batch, a result is complete when a folder
of the batch holds a report.json whose `request_fingerprint` is that of the prompt's resolved
request now, and its latents when they are saved. The fingerprint names the weights by what they
hold and includes every setting that changes numbers, so replaced weights or another
H3_EMULATE_FP4 redo every prompt. Results are matched by that fingerprint, not by position
(`match_existing`): a line inserted above the others runs alone, a moved prompt keeps the folder
its result is in, and the folders no prompt of the file claims are listed (`other_folders` in
batch.json), not silently left beside the new ones.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from h3core.batch.prompts import PromptEntry, folder_names
from h3core.batch.report import PromptResult, PromptStatus
from h3core.errors import ConfigError, H3Error
from h3core.files.text import read_json
from h3core.generate.report import request_fingerprint
from h3core.generate.request import GenerateRequest, ResolvedRun, resolve

if TYPE_CHECKING:
    from h3core.decode.plan import DecodePlan

REPORT_LIMIT = 64 << 20
"""The largest report.json a resume reads (one with --profile over many steps is a few MiB)."""


class BatchJob(BaseModel):
    """One `h3 generate --prompts FILE` command: the flags (every prompt's defaults) and where results go."""

    model_config = ConfigDict(frozen=True)
    template: GenerateRequest = Field(description="The flags as a request: what a prompt of the file does not set.")
    prompts_file: Path
    output: Path | None = Field(None, description="The batch folder (None: outputs/<time>-batch-<mode>-<N>-<4 hex>).")
    save_latents: bool = True
    overwrite: bool = Field(False, description="Replace a folder of h3 results at `output` whole: every prompt runs again.")
    decode: bool = Field(True, description="Decode each prompt's latents into its video.mp4 (one load of the VAEs for the batch).")
    video_vae: Path | None = None
    audio_vae: Path | None = None


@dataclass
class PlannedPrompt:
    """A prompt of the batch: its summary row, and its resolved run (None when resolving failed)."""

    result: PromptResult
    run: ResolvedRun | None
    decode: "DecodePlan | None" = None


def plan_prompts(template: GenerateRequest, entries: list[PromptEntry], video_vae: Path | None = None) -> list[PlannedPrompt]:
    """Resolve every prompt with the flags as defaults; a prompt that cannot run is marked failed.
    `video_vae`: the --video-vae flag (it also encodes keyframes)."""
    return [_plan_one(template, entry, index, name, video_vae) for index, (entry, name) in enumerate(zip(entries, folder_names(entries)))]


def _plan_one(template: GenerateRequest, entry: PromptEntry, index: int, name: str, video_vae: Path | None = None) -> PlannedPrompt:
    result = PromptResult(index=index, line=entry.line, prompt=entry.prompt, seed=entry.seed, folder=name)
    try:
        request = GenerateRequest(**{**template.model_dump(), **entry.overrides()})
        run = resolve(request, video_vae)
    except H3Error as err:
        return PlannedPrompt(result.model_copy(update={"status": PromptStatus.FAILED, "error": str(err)}), None)
    s = run.shape
    size = f"{s.width}x{s.height}, {s.frames} frames, {s.steps} steps"
    update = {"seed": run.request.seed, "size": size, "fingerprint": request_fingerprint(run)}
    return PlannedPrompt(result.model_copy(update=update), run)


def batch_fingerprint(job: BatchJob) -> str:
    """What makes two commands the same batch: the prompt file (its resolved path) and the flags
    every prompt starts from, as given (a changed line of the file is still the same batch)."""
    fields = {"prompts_file": str(Path(job.prompts_file).resolve()), "template": job.template.model_dump(mode="json"),
              "save_latents": job.save_latents, "decode": job.decode,
              "vaes": [str(Path(p).resolve()) if p else None for p in (job.video_vae, job.audio_vae)]}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def agreement_digest(planned: list[PlannedPrompt]) -> str:
    """What every torchrun rank must have resolved alike: each prompt's request (its portable
    fingerprint: the weights by content, not by path or time) or its error, in file order."""
    parts = [request_fingerprint(p.run, portable=True) if p.run is not None else f"failed: {p.result.error}" for p in planned]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def match_existing(planned: list[PlannedPrompt], folder: Path, save_latents: bool, decode: bool = False) -> list[str]:
    """Match the results already in `folder` to the prompts by fingerprint (module docstring).

    A prompt whose complete result is in its own folder, or in another one no other prompt
    claims, is marked skipped and keeps that folder. Every prompt that runs gets its numbered
    name, or that name with a suffix where a kept result holds it. Returns the folders no prompt
    claims (left as they are: a result whose line or weights changed, or that another version of
    the file asked for), except those a prompt now writes into (a changed line, redone in place)."""
    results = _results_in(folder, save_latents, decode)  # folder name -> fingerprint of the complete result in it
    by_fingerprint: dict[str, list[str]] = defaultdict(list)
    for name, fingerprint in sorted(results.items()):
        by_fingerprint[fingerprint].append(name)
    claimed: set[str] = set()
    waiting = [p for p in planned if p.run is not None]
    for p in list(waiting):  # first: a result already under the prompt's own name
        if results.get(p.result.folder) == p.result.fingerprint:
            _skip(p, folder, p.result.folder, claimed)
            waiting.remove(p)
    for p in waiting:  # then: its result under another name (the prompt moved in the file)
        free = [name for name in by_fingerprint.get(p.result.fingerprint or "", []) if name not in claimed]
        if free:
            _skip(p, folder, free[0], claimed)
    taken = set(claimed)
    for p in planned:
        if p.result.status is not PromptStatus.SKIPPED:
            p.result.folder = _free_name(p.result.folder, taken)
            taken.add(p.result.folder)
    return [name for name in _subfolders(folder) if name not in taken]


def _skip(p: PlannedPrompt, folder: Path, name: str, claimed: set[str]) -> None:
    p.result.status, p.result.folder, p.result.report = PromptStatus.SKIPPED, name, str(folder / name / "report.json")
    claimed.add(name)


def _free_name(name: str, taken: set[str]) -> str:
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}-{n}", n + 1
    return candidate


def _subfolders(folder: Path) -> list[str]:
    """The entries of a batch folder that may hold a prompt's result (not batch.json, staging or locks)."""
    try:
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _results_in(folder: Path, save_latents: bool, decode: bool = False) -> dict[str, str]:
    """Subfolder name -> the fingerprint of the complete result it holds."""
    found = {}
    for name in _subfolders(folder):
        fingerprint = written_fingerprint(folder / name)
        if fingerprint is not None and is_complete(folder / name, fingerprint, save_latents, decode):
            found[name] = fingerprint
    return found


def written_fingerprint(folder: Path) -> str | None:
    """The `request_fingerprint` of the report.json in `folder` (None: none, or none h3 can read)."""
    try:
        data = read_json(folder / "report.json", "report", REPORT_LIMIT, "it is redone")
    except ConfigError:
        return None
    written = data.get("request_fingerprint") if isinstance(data, dict) else None
    return written if isinstance(written, str) else None


def is_complete(folder: Path, fingerprint: str | None, save_latents: bool, decode: bool = False) -> bool:
    """`folder` holds the report of the request with `fingerprint` (and its latents when saved, its
    video.mp4 when decoded)."""
    wanted = [name for name, want in (("latents.safetensors", save_latents), ("video.mp4", decode)) if want]
    present = all((folder / name).is_file() and not (folder / name).is_symlink() for name in wanted)
    return fingerprint is not None and written_fingerprint(folder) == fingerprint and present


def to_run(planned: list[PlannedPrompt]) -> list[int]:
    """The indices of the prompts still to run, in file order."""
    return [p.result.index for p in planned if p.result.status is PromptStatus.PENDING]


def check_flags(template: GenerateRequest, video_vae: Path | None = None) -> None:
    """The flags alone (every prompt's defaults) must resolve: a bad flag is the command's error, not
    every prompt's (exit 2 before anything runs)."""
    try:
        resolve(template, video_vae)
    except ConfigError as err:
        raise ConfigError(f"{err} (the flags, which every prompt of --prompts starts from)") from None
