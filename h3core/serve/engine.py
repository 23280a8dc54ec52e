"""The serving engine: one World for the server's life, jobs in rounds of one per replica group.

It is the engine of `h3 generate --prompts` (`h3core.batch.run.run_round`,
`h3core.generate.resident`), fed by the job queue instead of a prompt file:

1. Start: the World's ranks start, load the denoiser (`preload`: every rank, for the server's
   layout), rank 0's text encoder and every rank's two VAEs, which stay loaded. Until then the API
   answers 503 to new jobs.
2. Each round: up to R queued jobs (R = `--replicas`) are claimed, oldest first, each resolved on
   its own (`to_generate_request`, `resolve`: a job that cannot run fails alone), encoded by rank 0's
   kept encoder, and run one per replica group in one `run_round`, each with its `JobControl`: a job
   deleted while it runs stops at its next step boundary, agreed by its whole group
   (`h3core.generate.control`), while the other groups go on. A round ends when its last job ends.
3. Each finished job is decoded on every rank of the World, as `h3 generate` decodes
   (`h3core.generate.decode_ranks.rank_decode`: the video's tiles shared out, the audio on the last
   rank, the clip blended on rank 0), one job after another.
   Its report, `video.mp4`, `preview.png`,
   `thumbnail.png` (its first frame) and latents are staged in `<state-dir>/jobs/<id>/` and published
   whole; only then is the job `completed`. A job deleted meanwhile is published nowhere.
4. A fault on the ranks (denoising or decoding) fails the round's jobs with its one line; the next
   round starts fresh ranks (and loads again). Ctrl-C / SIGTERM reach the caller (`h3core.serve.server`), which re-queues the
   running jobs: nothing of them is published.

Under torchrun every rank runs this loop: global rank 0 (the server) decides each round and
broadcasts it (`Order`; an idle one at least every second, so that the other ranks' wait never
reaches the collective timeout), every rank runs it, rank 0 writes.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from h3core import settings
from h3core.generate.control import Board, JobControl, Stopped
from h3core.generate.decode_ranks import hold_decoders
from h3core.batch.run import run_round
from h3core.errors import ConfigError, H3Error
from h3core.generate.fp4gate import with_fp4_selftest
from h3core.generate.request import GenerateJob, GenerateRequest, ResolvedRun, resolve
from h3core.generate.resident import encode_prompts_once, preload
from h3core.media import FPS
from h3core.serve.api import ApiError, VideoCreate
from h3core.serve.inputs import JobInputs, Limits
from h3core.serve.queue import JobQueue
from h3core.serve.request import to_generate_request
from h3core.runtime.context import RankContext
from h3core.runtime.world import World

if TYPE_CHECKING:
    from h3core.decode.plan import DecodePlan
    from h3core.decode.run import DecodeRun
    from h3core.decode.sources import VaeChoice
    from h3core.decode.vae_files import Role
    from h3core.generate.report import RankReport
    from h3core.reports.outputs import ResultsFolder

IDLE_S = 0.5  # how long the server waits for a job before it looks again (and, under torchrun, tells the ranks it idles)


class ServeJob(BaseModel):
    """One `h3 serve` command: the model and run flags (every job's defaults) and the server's own."""

    model_config = ConfigDict(frozen=True)
    template: GenerateRequest = Field(description="The flags as a request: what a job does not set.")
    state_dir: Path = Field(description="The job queue (jobs.sqlite3), each job's inputs and its published folder.")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0: a free port (the server says which).")
    api_key: str | None = Field(None, repr=False, description="Bearer key every route but /health needs (None: none).")
    allow_paths: list[Path] = Field(default_factory=list, description="Directories server-local keyframe and adapter paths may name (resolved).")
    limits: Limits = Field(default_factory=Limits)
    served_model: str = Field("h3", description="The model name jobs report and requests may give.")
    save_latents: bool = True
    video_vae: Path | None = None
    audio_vae: Path | None = None

    def generate_job(self, request: GenerateRequest) -> GenerateJob:
        return GenerateJob(request=request, decode=True, video_vae=self.video_vae, audio_vae=self.audio_vae, save_latents=self.save_latents)


@dataclass
class Metrics:
    """What /metrics shows beyond the queue's counts (this server's life)."""

    steps: int = 0
    step_seconds: float = 0.0
    denoise_seconds: float = 0.0
    decode_seconds: float = 0.0
    jobs_done: int = 0
    rank_peak_bytes: dict[int, int] = field(default_factory=dict)
    decode_peak_bytes: int = 0
    load_seconds: float = 0.0


@dataclass
class ServerState:
    """Shared by the HTTP threads, the progress pump and the engine."""

    job: ServeJob
    queue: JobQueue
    phase: str = "loading"  # loading | ok | stopping | failed
    message: str | None = None
    board: Board | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    running: dict[str, JobControl] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def folder_of(self, job_id: str) -> Path:
        return self.job.state_dir / "jobs" / job_id

    def inputs_of(self, job_id: str) -> Path:
        return self.job.state_dir / "inputs" / job_id

    def remove_files(self, job_id: str) -> None:
        """A deleted job's folder and inputs (its id is checked: it names no other path)."""
        for path in (self.folder_of(job_id), self.inputs_of(job_id)):
            shutil.rmtree(path, ignore_errors=True)

    def cancel(self, job_id: str) -> None:
        board = self.board
        if board is not None:
            board.cancel(JobControl(key=job_id))


class Order(BaseModel):
    """What every rank runs next (rank 0 decides; under torchrun it is broadcast)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    runs: list[ResolvedRun | None] = Field(default_factory=list, description="Per replica group its job's run (None: idle); empty: the round idles.")
    controls: list[JobControl | None] = Field(default_factory=list)


@dataclass
class _Claimed:
    row: dict[str, Any]
    run: ResolvedRun
    decode: "DecodePlan"


def plan_job(job: ServeJob, create: VideoCreate, inputs: JobInputs, beside: bool = True,
             within: "Callable[[ResolvedRun], None] | None" = None) -> tuple[ResolvedRun, "DecodePlan"]:
    """A job's run and decode, checked as `h3 generate` checks them (a 400 for what cannot run);
    `within`: the server's own caps on the resolved run, asked before the memory check (a request
    past a cap is told so, not that this machine lacks the memory for it)."""
    from h3core.generate.memory import run_device_bytes
    from h3core.generate.run import plan_run_decode

    request = to_generate_request(create, job.template, inputs, job.served_model)
    try:
        run = resolve(request)
        if within is not None:
            within(run)
        beside_bytes = run_device_bytes(run) if beside and run.request.device == "cuda" else 0  # the pipeline stays loaded
        decode = plan_run_decode(job.generate_job(request), run, beside_bytes=beside_bytes)
    except ConfigError as err:
        raise ApiError(400, str(err), "invalid_request") from None
    assert decode is not None
    return run, decode


class Engine:
    """The loop of module docstring; `run()` in the server's main thread (and on every torchrun rank)."""

    def __init__(self, state: ServerState, results: "ResultsFolder | None"):
        self.state, self.job, self.results = state, state.job, results
        self.template = resolve(self.job.template)
        self.world: World | None = None
        self.vaes: "dict[Role, VaeChoice] | None" = None
        self.leader = settings.is_rank_zero()
        self.torchrun = settings.under_torchrun()
        self._claimed: list[_Claimed] = []

    # -- the World ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """The ranks, the denoiser and the VAEs on each, the text encoder on rank 0."""
        started = time.perf_counter()
        req = self.template.request
        if self.leader:
            self.state.phase = "loading"
        self.world = World(req.world_size, req.device)
        if self.torchrun:
            from h3core.generate.report import request_fingerprint

            self.world.agree(request_fingerprint(self.template, portable=True), "server (the model and run flags)")
        self.state.board = Board(self.world.store) if self.leader else None
        self.world.run(preload, with_fp4_selftest(self.template))
        if self.vaes is None:  # every rank (under torchrun each finds the files on its machine)
            from h3core.generate.run import plan_run_decode

            decode = plan_run_decode(self.job.generate_job(req), self.template)
            assert decode is not None
            self.vaes = dict(decode.vaes)
        self.world.run(hold_decoders, self.vaes)
        self.state.metrics.load_seconds = time.perf_counter() - started
        if self.leader:
            self.state.phase = "ok"

    def close(self) -> None:
        if self.world is not None:  # every rank's pipeline and VAEs end with it
            self.world.close()
            self.world = None

    # -- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Rounds until the server stops (Ctrl-C, SIGTERM: raised here, handled by the caller)."""
        self.start()
        while True:
            order = self._order()
            if order is None:
                return
            if order.runs:
                self._round(order)

    def _order(self) -> Order | None:
        """The next round: rank 0 claims it; under torchrun every rank receives it (None: stop)."""
        order = self._claim() if self.leader else None
        if not self.torchrun:
            return order
        assert self.world is not None
        return next(r for r in self.world.run(_from_rank_zero, order) if r is not None)

    def _claim(self) -> Order:
        """Up to one job per replica group; an empty order when none is queued after `IDLE_S`."""
        groups = self.template.request.replicas
        claimed: list[_Claimed] = []
        while len(claimed) < groups:
            rows = self.state.queue.claim(groups - len(claimed))
            if not rows:
                break
            claimed.extend(c for c in (self._resolve(row) for row in rows) if c is not None)
        if not claimed:
            self.state.wake.wait(IDLE_S)
            self.state.wake.clear()
            return Order()
        self._claimed = claimed
        controls = [JobControl(key=c.row["id"]) for c in claimed]
        with self.state.lock:
            self.state.running.update({c.key: c for c in controls})
        pad = [None] * (groups - len(claimed))
        return Order(runs=[c.run for c in claimed] + pad, controls=controls + pad)  # type: ignore[operator]

    def _resolve(self, row: dict[str, Any]) -> _Claimed | None:
        """A claimed job's run; one that cannot run (a build, a file or the machine changed since it
        was accepted) fails alone."""
        try:
            create, inputs = VideoCreate.model_validate_json(row["request"]), JobInputs.model_validate_json(row["inputs"])
            run, decode = plan_job(self.job, create, inputs)
        except ApiError as err:
            self.state.queue.finish(row["id"], "failed", error_code=err.code, error_message=err.message)
            return None
        return _Claimed(row, run, decode)

    def _round(self, order: Order) -> None:
        """Every rank: encode (rank 0's kept encoder), denoise one job per group; rank 0 publishes."""
        assert self.world is not None
        runs = [r for r in order.runs if r is not None]
        slots = [i if r is not None else None for i, r in enumerate(order.runs)]
        try:
            texts = self.world.run(encode_prompts_once, runs, True)[0]
            per_replica = run_round(self.world, order.runs, texts, slots, order.controls)
            decoded = self._decode(order, per_replica)
        except H3Error as err:
            if self.leader:
                self._failed_round(err)
            if self.torchrun:
                raise  # torchrun stops every rank: the server ends here
            self.close()
            self.start()  # fresh ranks, loaded again
            return
        if self.leader:
            for replica, (claimed, outcomes) in enumerate(zip(self._claimed, per_replica or [])):
                self._finish(claimed, outcomes, replica, decoded[replica])
            self._claimed = []

    def _decode(self, order: Order, per_replica: "list[list[RankReport | Stopped]] | None") -> "list[DecodeRun | None]":
        """Every finished job's decode on every rank of the World, one job after another (a job
        stopped while it ran is not decoded); rank 0 gets the clips. Under torchrun rank 0 says which."""
        from h3core.generate.run import decode_on_ranks

        assert self.world is not None and self.vaes is not None
        done = [r for r, outcomes in enumerate(per_replica or []) if order.runs[r] is not None and not isinstance(outcomes[0], Stopped)] if self.leader else None
        if self.torchrun:
            done = next(r for r in self.world.run(_from_rank_zero, done) if r is not None)
        decoded: "list[DecodeRun | None]" = [None] * len(order.runs)
        for r in done or []:
            run = order.runs[r]
            assert run is not None
            latents = per_replica[r][0].latents if per_replica is not None else None  # type: ignore[union-attr]
            decoded[r] = decode_on_ranks(self.world, self.vaes, latents, run)
        return decoded

    # -- rank 0: a job's end -------------------------------------------------------------------------------------

    def _finish(self, claimed: _Claimed, outcomes: "list[RankReport | Stopped]", replica: int, decoded: "DecodeRun | None") -> None:
        job_id = claimed.row["id"]
        control = JobControl(key=job_id)
        progress = self.state.board.progress(control) if self.state.board is not None else None
        if progress is not None:  # (a job shorter than the pump's period: its first step is recorded here)
            self.state.queue.running(job_id, first_step_at=progress.first_step_at)
        try:
            if isinstance(outcomes[0], Stopped):
                self.state.queue.finish(job_id, "failed", error_code="cancelled", error_message="deleted while it ran")
                self.state.remove_files(job_id)
                return
            self._publish(claimed, outcomes, replica, decoded)  # type: ignore[arg-type]
        finally:
            with self.state.lock:
                self.state.running.pop(job_id, None)
            if self.state.board is not None:
                self.state.board.forget(control)

    def _publish(self, claimed: _Claimed, outcomes: "list[RankReport]", replica: int, decoded: "DecodeRun | None") -> None:
        """Stage and publish the job's folder, then mark it completed (or fail it with its one line)."""
        from h3core.decode.mp4 import first_frame_png
        from h3core.generate.files import output_bytes, write_outputs
        from h3core.generate.report import build_report

        assert self.results is not None
        job_id, queue = claimed.row["id"], self.state.queue
        report = build_report(claimed.run, outcomes)
        try:
            entry = self.results.entry(job_id, need_bytes=output_bytes(claimed.run, self.job.save_latents, claimed.decode), overwrite=True)
            try:
                write_outputs(report, outcomes[0], entry, self.job.save_latents, None, decoded=decoded)
                assert entry.staging is not None
                entry.write("thumbnail.png", first_frame_png((entry.staging / "video.mp4").read_bytes()))
                failure = report.failure()
                if failure is not None:
                    raise failure
                entry.publish()
                entry.finish()
            finally:
                entry.discard()  # a no-op once published
        except (H3Error, OSError) as err:
            queue.finish(job_id, "failed", error_code="generation_failed", error_message=" ".join(str(err).split()))
            return
        self._count(report, outcomes)
        timings = report.timings
        done = queue.finish(job_id, "completed", folder=str(self.state.folder_of(job_id)), progress=100, replica=replica,
                            denoise_seconds=timings.get("sampling"), decode_seconds=timings.get("decode"))
        if not done:  # deleted while it was written: it is gone
            self.state.remove_files(job_id)

    def _count(self, report: Any, outcomes: "list[RankReport]") -> None:
        m = self.state.metrics
        m.jobs_done += 1
        m.denoise_seconds += report.timings.get("sampling", 0.0)
        m.decode_seconds += report.timings.get("decode", 0.0)
        m.steps += len(report.step_seconds)
        m.step_seconds += sum(report.step_seconds)
        for r in outcomes:
            m.rank_peak_bytes[r.rank] = max(m.rank_peak_bytes.get(r.rank, 0), r.peak_memory_sampling_bytes or 0)
        if report.decode is not None:
            m.decode_peak_bytes = max(m.decode_peak_bytes, report.decode.peak_memory_bytes)

    def _failed_round(self, err: H3Error) -> None:
        for claimed in self._claimed:
            job_id = claimed.row["id"]
            self.state.queue.finish(job_id, "failed", error_code="generation_failed", error_message=" ".join(str(err).split()))
            with self.state.lock:
                self.state.running.pop(job_id, None)
        self._claimed = []


def _from_rank_zero(ctx: RankContext, value: Any) -> Any:
    """World task: rank 0's `value` on every rank."""
    import torch.distributed as dist

    if ctx.group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


def frames_seconds(frames: int) -> str:
    """A clip's length as the API says it: '4', '0.917'."""
    return f"{frames / FPS:.3g}"


class ProgressPump:
    """A thread that copies the running jobs' step progress from the store into the queue (and the
    step-time metric), every `period` seconds, until `stop()`."""

    def __init__(self, state: ServerState, period: float = 0.25):
        self.state, self.period = state, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="h3-serve-progress", daemon=True)

    def start(self) -> "ProgressPump":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - a store that went away with its World: the next round has a new one
                continue

    def pump(self) -> None:
        board = self.state.board
        if board is None:
            return
        with self.state.lock:
            running = list(self.state.running.items())
        for job_id, control in running:
            progress = board.progress(control)
            if progress is None or progress.steps == 0:
                if progress is not None:
                    self.state.queue.running(job_id, first_step_at=progress.first_step_at)
                continue
            percent = min(99, progress.step * 99 // progress.steps)
            self.state.queue.running(job_id, progress=percent, first_step_at=progress.first_step_at)
