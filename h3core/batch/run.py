"""`run_batch(job)`: the one call behind `h3 generate --prompts FILE`.

1. Before any rank starts: the file is read whole (a malformed one is one line, exit 2), the flags
   resolved, every prompt resolved on its own (`h3core.batch.plan`; a prompt that cannot run is
   recorded as failed). Under torchrun every process did that with its own copy of the file and
   flags: the ranks first check that they all resolved the same batch (`World.agree`), or all
   refuse in one line before anything is written. Then the batch folder is checked and locked: a
   folder of another batch is refused (unless `--overwrite`, which replaces it whole), and in the
   folder of the same batch the results already there are matched to the prompts by what they
   are (`match_existing`) and skipped.
2. One World for the batch. Rank 0 loads the text encoder once, encodes every prompt still to
   run, and releases it; then each prompt is one `World.run(denoise_request, ...)`: the ranks keep
   the denoiser they loaded for the first prompt (`h3core.generate.resident`), so later prompts pay
   no load. This process writes each prompt's folder (report.json, latents, preview, as `h3
   generate` writes them) the moment its ranks return, published whole, and batch.json after
   every prompt.
3. A prompt that fails on the ranks is recorded with its one-line error and the batch goes on in a
   fresh World (a fault closes a World: the next prompt loads again; under torchrun the batch
   stops, as torchrun stops every rank). What the folder itself refuses stops the batch instead
   of computing prompts that must be discarded: a disk that cannot hold the next prompt's
   results (checked before each round, and a full disk while writing), a batch folder deleted or
   replaced while the batch ran (exit 1). Ctrl-C or SIGTERM keeps the finished prompts and the
   summary, writes nothing of the prompt in flight, and exits 130 (143).

With `--replicas R` the World's ranks form R independent groups (`h3core.parallel.layout`): the
prompts still to run are taken R at a time, one per group, in one `World.run` (`run_round`); the
last round may leave groups idle. Each prompt runs exactly once, on one group. A fault on any
group's ranks closes the World: the prompts of that round are recorded as failed (a rerun of the
same command redoes them), the next round starts fresh ranks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from h3core import settings
from h3core.batch.plan import (
    BatchJob,
    PlannedPrompt,
    agreement_digest,
    batch_fingerprint,
    check_flags,
    match_existing,
    plan_prompts,
    to_run,
)
from h3core.batch.prompts import read_prompts
from h3core.batch.report import REPORT_NAME, BatchProgress, BatchReport, ProgressCallback, PromptStatus
from h3core.errors import ConfigError, H3Error, Interrupted, NoRoom, OutputError, stop_name
from h3core.generate.files import output_bytes, write_outputs
from h3core.generate.fp4gate import with_fp4_selftest
from h3core.generate.report import RankReport, StepDone, build_report
from h3core.generate.request import ResolvedRun
from h3core.generate.resident import EncodedPrompts, denoise_round, drop_held, encode_prompts_once
from h3core.reports.outputs import ResultsFolder, default_folder, output_error
from h3core.reports.schema import Versions, report_json, timestamp
from h3core.runtime.context import RankContext
from h3core.runtime.world import World

if TYPE_CHECKING:
    from h3core.generate.control import JobControl
    from h3core.decode.run import DecodeRun


def run_batch(job: BatchJob, on_progress: ProgressCallback | None = None) -> BatchReport | None:
    """Run every prompt of `job` (module docstring). Returns the summary (None on torchrun ranks
    other than 0); a failed prompt is recorded in it: call `failure()` for the exit code."""
    entries = read_prompts(job.prompts_file)
    check_flags(job.template, job.video_vae)
    planned = plan_prompts(job.template, entries, job.video_vae)
    plan_decodes(job, planned)
    batch = _Batch(job, planned, on_progress)
    try:
        if settings.under_torchrun():
            batch.ranks().agree(agreement_digest(planned), f"batch (--prompts {job.prompts_file} and the flags)")
        if not settings.is_rank_zero():
            batch.run(None)
            return None
        need = sum(output_bytes(p.run, job.save_latents, p.decode) for p in planned if p.run is not None)
        req = job.template
        path = job.output or default_folder(f"batch-{req.mode.value}-{req.world_size}")
        with ResultsFolder(path, "--output", REPORT_NAME, need_bytes=need) as folder:
            batch.other_folders = _take_folder(folder, job, planned)
            return batch.run(folder)
    finally:
        batch.close_world()


def _take_folder(folder: ResultsFolder, job: BatchJob, planned: list[PlannedPrompt]) -> list[str]:
    """A folder that holds a batch is this batch's (then its results are matched to the prompts;
    returns the folders no prompt claims), or is replaced whole with `--overwrite`, or is refused."""
    if not folder.resumed:
        return []
    if job.overwrite:
        folder.clear()
        return []
    index = folder.read_index()
    theirs = index.get("batch_fingerprint") if isinstance(index, dict) else None
    if theirs != batch_fingerprint(job):
        written = index.get("prompts_file") if isinstance(index, dict) else None
        what = f"the batch of --prompts {written}" if isinstance(written, str) else f"a {REPORT_NAME} this version of h3 cannot take as this batch's"
        raise ConfigError(
            f"--output {folder.path} holds {what} with other flags or another prompt file; h3 does not mix batches: "
            "choose a new folder, or pass --overwrite to replace it whole"
        )
    return match_existing(planned, folder.path, job.save_latents, job.decode)


def plan_decodes(job: BatchJob, planned: list[PlannedPrompt]) -> None:
    """Each prompt's decode (`h3core.decode.plan`), decided before any rank starts: the VAEs must be
    there for every prompt (a missing or wrong one is the command's error, exit 2); a clip too big to
    decode beside the held pipeline on its GPU is that prompt's failure."""
    if not job.decode:
        return
    from h3core.errors import ResourceLimit
    from h3core.generate.memory import run_device_bytes
    from h3core.generate.run import plan_run_decode
    from h3core.generate.request import GenerateJob

    as_job = GenerateJob(request=job.template, decode=True, video_vae=job.video_vae, audio_vae=job.audio_vae)
    for p in planned:
        if p.run is None:
            continue
        beside = run_device_bytes(p.run) if p.run.request.device == "cuda" else 0  # the batch's pipeline stays loaded meanwhile
        try:
            p.decode = plan_run_decode(as_job, p.run, beside_bytes=beside)
        except ResourceLimit as err:
            p.result.status, p.result.error = PromptStatus.FAILED, str(err)
            p.run = None


def run_round(world: World, runs: list[ResolvedRun | None], texts: EncodedPrompts | None, slots: list[int | None],
              controls: "list[JobControl | None] | None" = None) -> list[list[RankReport]] | None:
    """One prompt per replica group on the ranks of `world` (`runs[r]`: replica r's, None when it
    idles; `slots[r]`: its place in `texts`). Per replica, its ranks' outcomes, its lead's (the
    latents) first; None on torchrun ranks other than 0. `controls[r]` (`h3 serve`): replica r's
    request can be stopped at a step boundary; its ranks' outcomes are then `Stopped`."""
    mine = [texts.texts[s] if texts is not None and s is not None else [] for s in slots]
    seconds = [texts.seconds[s] if texts is not None and s is not None else 0.0 for s in slots]
    encoded = texts.for_reports() if texts is not None else {}
    extra = {"controls": controls} if controls is not None else {}
    outcomes = world.run(denoise_round, runs, mine if texts is not None else None, seconds, encoded, **extra)
    if not world.is_main:
        return None
    width = len(outcomes) // len(runs)  # the ranks of one replica: consecutive, its lead first
    return [outcomes[r * width : (r + 1) * width] for r in range(len(runs))]


class _Batch:
    """One batch: the prompts to run, in order, on one World (a new one after a fault), the summary
    rewritten after each. `folder` is None on torchrun ranks other than 0 (they write nothing)."""

    def __init__(self, job: BatchJob, planned: list[PlannedPrompt], on_progress: ProgressCallback | None):
        self.job, self.planned, self.on_progress = job, planned, on_progress
        self.folder: ResultsFolder | None = None
        self.world: World | None = None
        self.current = ""
        self.other_folders: list[str] = []

    def run(self, folder: ResultsFolder | None) -> BatchReport:
        self.folder = folder
        req = self.job.template
        self.report = BatchReport(
            created=timestamp(), updated=timestamp(), prompts_file=str(self.job.prompts_file), mode=req.mode,
            world_size=req.world_size, device=req.device, directory=str(folder.path) if folder else "",
            resumed=bool(folder and folder.resumed), batch_fingerprint=batch_fingerprint(self.job),
            other_folders=self.other_folders, prompts=[p.result for p in self.planned], versions=Versions.collect(),
        )
        self._write()
        try:
            todo = [self.planned[i] for i in self._agreed(to_run(self.planned))]
            texts = self._encode([p.run for p in todo])  # type: ignore[misc]
            groups = self.job.template.replicas
            for first in range(0, len(todo), groups):
                self._run_round(todo[first : first + groups], texts, first)
            self._check_kept()
            self.report.complete = True
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (`Terminated`)
            self._stop(f"interrupted ({stop_name(stop)})")
            done = sum(p.status is not PromptStatus.PENDING for p in self.report.prompts)
            raise Interrupted.by(stop, (
                f" after {done} of {len(self.planned)} prompts; the finished ones are in "
                f"{self.report.directory} ({REPORT_NAME} says complete: false): run the same command again to resume"
            )) from None
        except H3Error as err:
            self._stop(f"the batch stopped: {err}")
            raise
        finally:
            self.close_world()
        self._progress()
        self._write()
        return self.report

    # -- the ranks --------------------------------------------------------------------------------------

    def ranks(self) -> World:
        """The batch's World, started again after a fault closed it (a start that fails ends the batch)."""
        if self.world is None or self.world.closed:
            self.close_world()
            req = self.job.template
            self.world = World(req.world_size, req.device, on_progress=self._on_step)
        return self.world

    def close_world(self) -> None:
        if self.world is not None:  # what every rank held (its pipeline, its VAEs) ends with the World
            self.world.close()
            self.world = None

    def _decode(self, world: World, prompts: list[PlannedPrompt], per_replica: list[list[RankReport]] | None) -> list["DecodeRun | None"]:
        """Each prompt's decode on every rank of the World (`rank_decode`: the VAEs loaded by the first
        prompt and held for the batch); every rank takes part, only this process (rank 0) gets the clips."""
        from h3core.generate.run import decode_on_ranks

        out: list["DecodeRun | None"] = []
        for replica, prompt in enumerate(prompts):
            if prompt.decode is None or prompt.run is None:
                out.append(None)
                continue
            latents = per_replica[replica][0].latents if per_replica is not None else None
            out.append(decode_on_ranks(world, prompt.decode.vaes, latents, prompt.run))
        return out

    def _agreed(self, indices: list[int]) -> list[int]:
        """Under torchrun, every rank runs the prompts rank 0 chose (only rank 0 reads the folder)."""
        if not settings.under_torchrun():
            return indices
        return next(r for r in self.ranks().run(_from_rank_zero, indices) if r is not None)

    def _encode(self, runs: list[ResolvedRun]) -> EncodedPrompts | None:
        if not runs:
            return None
        texts = self.ranks().run(encode_prompts_once, runs)[0]
        if texts is not None:
            self.report.text_encoder_seconds = texts.load_seconds + sum(texts.seconds)
        return texts

    # -- one prompt ---------------------------------------------------------------------------------------

    def _run_round(self, prompts: list[PlannedPrompt], texts: EncodedPrompts | None, first: int) -> None:
        """Up to one prompt per replica group at once (`first`: the first one's place in `texts`).
        The disk must hold their results before they are computed (`NoRoom` stops the batch)."""
        if self.folder is not None:
            self.folder.check_room(sum(output_bytes(p.run, self.job.save_latents, p.decode) for p in prompts if p.run is not None))
        groups = self.job.template.replicas
        for p in prompts:  # CUDA fp4: each GPU's GEMM checked before its ranks first need it (once per batch)
            p.run = with_fp4_selftest(p.run) if p.run is not None else None
        runs = [p.run for p in prompts] + [None] * (groups - len(prompts))
        slots = [first + i for i in range(len(prompts))] + [None] * (groups - len(prompts))
        self.current = ", ".join(p.result.folder for p in prompts)
        self._progress()
        started = time.perf_counter()
        world = self.ranks()
        try:
            try:
                per_replica = run_round(world, runs, texts, slots)
                decoded = self._decode(world, prompts, per_replica)
            except H3Error as err:  # on the ranks: the round's prompts failed, the batch goes on
                for prompt in prompts:
                    self._failed(prompt, err, started)
                if settings.under_torchrun():
                    raise  # torchrun stops every rank: the batch ends here
                if world.world_size == 1 and not world.closed:
                    world.run(drop_held)  # a fault in this process: load afresh rather than reuse what it left
                return
            for replica, (prompt, outcomes) in enumerate(zip(prompts, per_replica or [])):
                prompt.result.replica = replica
                self._publish_or_fail(prompt, outcomes, started, decoded[replica])
        except BaseException:
            self.current = ""
            self._write_if_possible()
            raise
        self.current = ""
        self._write()

    def _publish_or_fail(self, prompt: PlannedPrompt, outcomes: list[RankReport], started: float, decoded: "DecodeRun | None") -> None:
        """A folder the file system refuses is that prompt's failure, not its round's; a full disk,
        or a batch folder that is gone, stops the batch (what follows could not be written either)."""
        try:
            self._publish(prompt, outcomes, started, decoded)
        except NoRoom:
            raise
        except OutputError as err:
            assert self.folder is not None
            self.folder.check_intact()
            self._failed(prompt, err, started)

    def _publish(self, prompt: PlannedPrompt, outcomes: list[RankReport], started: float, decoded: "DecodeRun | None") -> None:
        """Write the prompt's folder as `h3 generate` does, published whole; record it as done."""
        assert self.folder is not None and prompt.run is not None
        report = build_report(prompt.run, outcomes)
        folder = self.folder.entry(prompt.result.folder, need_bytes=output_bytes(prompt.run, self.job.save_latents, prompt.decode), overwrite=True)
        try:
            write_outputs(report, outcomes[0], folder, self.job.save_latents, None, decoded=decoded)
            folder.publish()
            folder.finish()
        except OSError as err:
            raise output_error(f"cannot write {folder.path}", err, "this prompt's folder was not written") from None
        finally:
            folder.discard()  # a no-op once published
        r = prompt.result
        r.status, r.report, r.error = PromptStatus.OK, report.files.report if report.files else None, None
        r.seconds = time.perf_counter() - started
        r.load_seconds, r.sampling_seconds = report.timings.get("load", 0.0), report.timings.get("sampling")

    def _check_kept(self) -> None:
        """At the end: the batch folder and every result it lists are still there (nothing lost unseen)."""
        if self.folder is None:
            return
        self.folder.check_intact()
        for p in self.report.prompts:
            if p.status in (PromptStatus.OK, PromptStatus.SKIPPED) and not (self.folder.path / p.folder / "report.json").is_file():
                p.status, p.error = PromptStatus.FAILED, f"its folder {self.folder.path / p.folder} was removed while the batch ran"

    def _failed(self, prompt: PlannedPrompt, err: H3Error, started: float) -> None:
        r = prompt.result
        r.status, r.error, r.seconds = PromptStatus.FAILED, str(err), time.perf_counter() - started

    # -- the summary and progress ---------------------------------------------------------------------------

    def _stop(self, why: str) -> None:
        self.report.stopped = why
        self._write_if_possible()

    def _write_if_possible(self) -> None:
        """batch.json while the batch stops for another reason: that reason is the line to show (a
        batch.json that cannot be rewritten keeps the last one written, which is true still)."""
        try:
            self._write()
        except OutputError:
            pass

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
