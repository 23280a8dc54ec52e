"""A request's control channel while it runs on resident ranks (`h3 serve`): stop it at a step
boundary, and follow its steps, through the World's key-value store (`RankContext.store`).

Why the store: a serving job runs inside one `World.run` that lasts until every replica group's
request is done, so nothing can be sent to the ranks meanwhile, and under torchrun the group that
runs a job may be on another machine than the server. The store (the rendezvous TCP store spawned
and torchrun ranks already share, an in-process `HashStore` at world size 1) reaches all of them.

Two keys per request (`JobControl.key`: the job's id, checked to hold no `/`):

- `h3/cancel/<key>`: set by the server (`Board.cancel`). Before every step each rank of the request's
  replica group calls its `RankGate`: the group's lead (local rank 0 of branch 0) reads the flag,
  and ONE broadcast of that value from the lead over the replica's group (both CFG halves with CFG
  parallel) gives every rank of the group the same answer at the same step. A flag read by each rank
  on its own would be seen by some ranks one step later than by others, and the group's collectives
  would part ways (a hang); the broadcast makes the decision a value, not a moment. On True the loop
  raises `StepsStopped` on every rank of the group, which `denoise_round` turns into a `Stopped`
  outcome: the other groups' requests of the round go on, and the World stays usable.
- `h3/progress/<key>`: written by the lead after every step (and before the first, with the wall
  time the first step started): `Progress`, read by the server's progress pump (`Board.progress`).

A run without a control (`h3 generate`, `--prompts`) has no gate: no collective is added to its steps.
"""

from __future__ import annotations

import json
import re
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from h3core.generate.report import StepDone
    from h3core.parallel.layout import RankGroups
    from h3core.runtime.context import RankContext

_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class JobControl(BaseModel):
    """What a rank needs to build its gate for one request (sent to every rank with the round)."""

    model_config = ConfigDict(frozen=True)
    key: str = Field(pattern=_KEY.pattern, description="The request's key in the store (a job id).")

    @property
    def cancel_key(self) -> str:
        return f"h3/cancel/{self.key}"

    @property
    def progress_key(self) -> str:
        return f"h3/progress/{self.key}"


class Progress(BaseModel):
    """A request's steps so far, as its group's lead wrote them."""

    step: int
    steps: int
    step_seconds: float | None = None
    first_step_at: float = Field(description="Wall time (time.time()) the first step started on the lead.")
    at: float = Field(description="Wall time of this record.")


class Stopped(BaseModel):
    """A rank's outcome of a request its gate stopped: `step` steps of `steps` had run."""

    step: int
    steps: int


class RankGate:
    """One rank's gate for one request: `__call__(step)` before each step (module docstring), `report`
    after each (the lead writes the progress)."""

    def __init__(self, ctx: "RankContext", control: JobControl, groups: "RankGroups"):
        layout, c = groups.layout, groups.coords
        self.store, self.control, self.device = ctx.store, control, ctx.device
        self.group = groups.halves if layout.cfg_parallel else groups.sequence  # every rank of the replica (None: one rank)
        self.lead = layout.rank_of(c.replica, 0, 0)
        self.is_lead = groups.leads_replica
        self.first_step_at: float | None = None
        assert self.store is not None, "a gated request needs the World's store"

    def __call__(self, step: int) -> bool:
        """True when the request is to stop before `step`: the lead's reading, the same on every rank."""
        flag = 0
        if self.is_lead:
            if self.first_step_at is None:
                self.first_step_at = time.time()
                self._write(0, 0, None)
            flag = int(self.store.check([self.control.cancel_key]))
        if self.group is not None:
            import torch
            import torch.distributed as dist

            value = torch.tensor([flag], dtype=torch.int32, device=self.device)
            dist.broadcast(value, src=self.lead, group=self.group)
            flag = int(value.item())
        return bool(flag)

    def report(self, done: "StepDone") -> None:
        if self.is_lead:
            self._write(done.step, done.steps, done.seconds)

    def _write(self, step: int, steps: int, seconds: float | None) -> None:
        record = Progress(step=step, steps=steps, step_seconds=seconds, first_step_at=self.first_step_at or time.time(), at=time.time())
        self.store.set(self.control.progress_key, record.model_dump_json())


class Board:
    """The launching process's side of the store (the server): cancel a request, read its progress,
    forget its keys. Thread-safe enough for a server: every call is one store operation, and the
    store clients serialize their own operations."""

    def __init__(self, store: Any):
        self.store = store

    def cancel(self, control: JobControl) -> None:
        self.store.set(control.cancel_key, "1")

    def progress(self, control: JobControl) -> Progress | None:
        if not self.store.check([control.progress_key]):
            return None
        try:
            return Progress.model_validate(json.loads(self.store.get(control.progress_key)))
        except ValueError:
            return None

    def forget(self, control: JobControl) -> None:
        for key in (control.cancel_key, control.progress_key):
            try:
                self.store.delete_key(key)
            except RuntimeError:
                pass  # (a store without deletion keeps a few bytes per job)
