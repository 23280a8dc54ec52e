"""`run_batch(job)`: the one call behind `h3 generate --prompts FILE`.

1. Before any rank starts: the file is read whole (a malformed one is one line, exit 2), the flags
   resolved, every prompt resolved on its own (`h3core.batch.plan`; a prompt that cannot run is
   recorded as failed), the batch folder checked and locked, and the prompts an earlier run of
   the same command completed are skipped.
2. One World for the batch. Rank 0 loads the text encoder once, encodes every prompt still to
   run, and releases it; then each prompt is one `World.run(denoise_request, ...)`: the ranks keep
   the denoiser they loaded for the first prompt (`h3core.generate.resident`), so later prompts pay
   no load. This process writes each prompt's folder (report.json, latents, preview, as `h3
   generate` writes them) the moment its ranks return, published whole, and batch.json after
   every prompt.
3. A prompt that fails on the ranks is recorded with its one-line error and the batch goes on in a
   fresh World (a fault closes a World: the next prompt loads again; under torchrun the batch
   stops, as torchrun stops every rank). Ctrl-C keeps the finished prompts and the summary, writes
   nothing of the prompt in flight, and exits 130.

With `--replicas R` the World's ranks form R independent groups (`h3core.parallel.layout`): the
prompts still to run are taken R at a time, one per group, in one `World.run` (`run_round`); the
last round may leave groups idle. Each prompt runs exactly once, on one group. A fault on any
group's ranks closes the World: the prompts of that round are recorded as failed (a rerun of the
same command redoes them), the next round starts fresh ranks.
"""

from __future__ import annotations

import time
from typing import Any

from h3core import settings
from h3core.batch.plan import BatchJob, PlannedPrompt, check_flags, mark_complete, plan_prompts, to_run
from h3core.batch.prompts import read_prompts
from h3core.batch.report import REPORT_NAME, BatchProgress, BatchReport, ProgressCallback, PromptStatus
from h3core.errors import H3Error, Interrupted, OutputError
from h3core.files.paths import os_error_reason
from h3core.generate.files import output_bytes, write_outputs
from h3core.generate.report import RankReport, StepDone, build_report
from h3core.generate.request import ResolvedRun
from h3core.generate.resident import EncodedPrompts, denoise_round, drop_held, encode_prompts_once
from h3core.reports.outputs import ResultsFolder, default_folder
from h3core.reports.schema import Versions, report_json, timestamp
from h3core.runtime.context import RankContext
from h3core.runtime.world import World


def run_batch(job: BatchJob, on_progress: ProgressCallback | None = None) -> BatchReport | None:
    """Run every prompt of `job` (module docstring). Returns the summary (None on torchrun ranks
    other than 0); a failed prompt is recorded in it: call `failure()` for the exit code."""
    entries = read_prompts(job.prompts_file)
    check_flags(job.template)
    planned = plan_prompts(job.template, entries)
    if not settings.is_rank_zero():
        _Batch(job, planned, None, on_progress).run()
        return None
    need = sum(output_bytes(p.run, job.save_latents) for p in planned if p.run is not None)
    req = job.template
    path = job.output or default_folder(f"batch-{req.mode.value}-{req.world_size}")
    with ResultsFolder(path, "--output", REPORT_NAME, need_bytes=need) as folder:
        if folder.resumed and not job.overwrite:
            mark_complete(planned, folder.path, job.save_latents)
        return _Batch(job, planned, folder, on_progress).run()


def run_round(world: World, runs: list[ResolvedRun | None], texts: EncodedPrompts | None, slots: list[int | None]) -> list[list[RankReport]] | None:
    """One prompt per replica group on the ranks of `world` (`runs[r]`: replica r's, None when it
    idles; `slots[r]`: its place in `texts`). Per replica, its ranks' outcomes, its lead's (the
    latents) first; None on torchrun ranks other than 0."""
    mine = [texts.texts[s] if texts is not None and s is not None else [] for s in slots]
    seconds = [texts.seconds[s] if texts is not None and s is not None else 0.0 for s in slots]
    encoded = texts.for_reports() if texts is not None else {}
    outcomes = world.run(denoise_round, runs, mine if texts is not None else None, seconds, encoded)
    if not world.is_main:
        return None
    width = len(outcomes) // len(runs)  # the ranks of one replica: consecutive, its lead first
    return [outcomes[r * width : (r + 1) * width] for r in range(len(runs))]


class _Batch:
    """One batch: the prompts to run, in order, on one World (a new one after a fault), the summary
    rewritten after each. `folder` is None on torchrun ranks other than 0 (they write nothing)."""

    def __init__(self, job: BatchJob, planned: list[PlannedPrompt], folder: ResultsFolder | None, on_progress: ProgressCallback | None):
        self.job, self.planned, self.folder, self.on_progress = job, planned, folder, on_progress
        self.world: World | None = None
        self.current = ""
        req = job.template
        self.report = BatchReport(
            created=timestamp(), updated=timestamp(), prompts_file=str(job.prompts_file), mode=req.mode,
            world_size=req.world_size, device=req.device, directory=str(folder.path) if folder else "",
            resumed=bool(folder and folder.resumed), prompts=[p.result for p in planned], versions=Versions.collect(),
        )

    def run(self) -> BatchReport:
        self._write()
        try:
            todo = [self.planned[i] for i in self._agreed(to_run(self.planned))]
            texts = self._encode([p.run for p in todo])  # type: ignore[misc]
            groups = self.job.template.replicas
            for first in range(0, len(todo), groups):
                self._run_round(todo[first : first + groups], texts, first)
            self.report.complete = True
        except KeyboardInterrupt:
            self._stop("interrupted (Ctrl-C)")
            done = sum(p.status is not PromptStatus.PENDING for p in self.report.prompts)
            raise Interrupted(
                f"interrupted (Ctrl-C) after {done} of {len(self.planned)} prompts; the finished ones are in "
                f"{self.report.directory} ({REPORT_NAME} says complete: false): run the same command again to resume"
            ) from None
        except H3Error as err:
            self._stop(f"the batch stopped: {err}")
            raise
        finally:
            self._close_world()
        self._progress()
        self._write()
        return self.report

    # -- the ranks --------------------------------------------------------------------------------------

    def _ranks(self) -> World:
        """The batch's World, started again after a fault closed it (a start that fails ends the batch)."""
        if self.world is None or self.world.closed:
            self._close_world()
            req = self.job.template
            self.world = World(req.world_size, req.device, on_progress=self._on_step)
        return self.world

    def _close_world(self) -> None:
        if self.world is not None:  # what every rank held (its pipeline) ends with the World
            self.world.close()
            self.world = None

    def _agreed(self, indices: list[int]) -> list[int]:
        """Under torchrun, every rank runs the prompts rank 0 chose (only rank 0 reads the folder)."""
        if not settings.under_torchrun():
            return indices
        return next(r for r in self._ranks().run(_from_rank_zero, indices) if r is not None)

    def _encode(self, runs: list[ResolvedRun]) -> EncodedPrompts | None:
        if not runs:
            return None
        texts = self._ranks().run(encode_prompts_once, runs)[0]
        if texts is not None:
            self.report.text_encoder_seconds = texts.load_seconds + sum(texts.seconds)
        return texts

    # -- one prompt ---------------------------------------------------------------------------------------

    def _run_round(self, prompts: list[PlannedPrompt], texts: EncodedPrompts | None, first: int) -> None:
        """Up to one prompt per replica group at once (`first`: the first one's place in `texts`)."""
        groups = self.job.template.replicas
        runs = [p.run for p in prompts] + [None] * (groups - len(prompts))
        slots = [first + i for i in range(len(prompts))] + [None] * (groups - len(prompts))
        self.current = ", ".join(p.result.folder for p in prompts)
        self._progress()
        started = time.perf_counter()
        world = self._ranks()
        try:
            per_replica = run_round(world, runs, texts, slots)
            for replica, (prompt, outcomes) in enumerate(zip(prompts, per_replica or [])):
                prompt.result.replica = replica
                self._publish_or_fail(prompt, outcomes, started)
        except H3Error as err:
            for prompt in prompts:
                if prompt.result.status is PromptStatus.PENDING:
                    self._failed(prompt, err, started)
            if settings.under_torchrun():
                raise  # torchrun stops every rank: the batch ends here
            if world.world_size == 1 and not world.closed:
                world.run(drop_held)  # a fault in this process: load afresh rather than reuse what it left
        finally:
            self.current = ""
            self._write()

    def _publish_or_fail(self, prompt: PlannedPrompt, outcomes: list[RankReport], started: float) -> None:
        """A folder the file system refuses is that prompt's failure, not its round's."""
        try:
            self._publish(prompt, outcomes, started)
        except OutputError as err:
            self._failed(prompt, err, started)

    def _publish(self, prompt: PlannedPrompt, outcomes: list[RankReport], started: float) -> None:
        """Write the prompt's folder as `h3 generate` does, published whole; record it as done."""
        assert self.folder is not None and prompt.run is not None
        report = build_report(prompt.run, outcomes)
        folder = self.folder.entry(prompt.result.folder, need_bytes=output_bytes(prompt.run, self.job.save_latents), overwrite=True)
        try:
            write_outputs(report, outcomes[0], folder, self.job.save_latents, None)
            folder.publish()
            folder.finish()
        except OSError as err:
            raise OutputError(f"cannot write {folder.path}: {os_error_reason(err)}; this prompt's folder was not written") from None
        finally:
            folder.discard()  # a no-op once published
        r = prompt.result
        r.status, r.report, r.error = PromptStatus.OK, report.files.report if report.files else None, None
        r.seconds = time.perf_counter() - started
        r.load_seconds, r.sampling_seconds = report.timings.get("load", 0.0), report.timings.get("sampling")

    def _failed(self, prompt: PlannedPrompt, err: H3Error, started: float) -> None:
        r = prompt.result
        r.status, r.error, r.seconds = PromptStatus.FAILED, str(err), time.perf_counter() - started

    # -- the summary and progress ---------------------------------------------------------------------------

    def _stop(self, why: str) -> None:
        self.report.stopped = why
        self._write()

    def _write(self) -> None:
        if self.folder is None:
            return
        self.report.updated = timestamp()
        self.report.loads = sum(1 for p in self.report.prompts if p.status is PromptStatus.OK and (p.load_seconds or 0) > 0)
        self.folder.write_index(report_json(self.report))

    def _on_step(self, message: Any) -> None:
        if isinstance(message, StepDone):
            self._progress(message)

    def _progress(self, step: StepDone | None = None) -> None:
        if self.on_progress is None:
            return
        done = sum(p.status is not PromptStatus.PENDING for p in self.report.prompts)
        self.on_progress(BatchProgress(
            done=done, total=len(self.report.prompts), prompt=self.current,
            step=step.step if step else 0, steps=step.steps if step else 0, step_seconds=step.seconds if step else None,
        ))


def _from_rank_zero(ctx: RankContext, value: Any) -> Any:
    """World task: rank 0's `value` on every rank (torchrun: each process planned on its own)."""
    import torch.distributed as dist

    if ctx.group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]
