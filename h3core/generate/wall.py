"""Where the wall time of one `h3 generate` went (issue 35.7), measured around the real calls.

`WallClock` is started when the run begins (`h3core.generate.run.generate`) and marks each stage as
it ends; `WallTime` is the split the report records and `h3 generate` prints: the process's own
start (the interpreter, imports, parsing the command: from the kernel's record of when the process
began), the checks, the ranks' start (processes, their imports and process group: what the ranks'
wall time holds beyond their measured phases), each component's load, text, denoise, decode and the
files written. Phases that ran on the ranks are the slowest rank's, as `timings` has them.
"""

from __future__ import annotations

import os
import time

from pydantic import BaseModel, Field


def process_age() -> float | None:
    """Seconds since this process began (Linux: its start time in /proc against the boot clock, 10 ms
    resolution); None where that is not known."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5), counted after the name
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class WallTime(BaseModel):
    """Seconds of one run's wall time, stage by stage; `total` is the process's start to the report."""

    start: float | None = Field(description="The process's start to the run: interpreter, imports, the command parsed (None: unknown on this OS).")
    resolve: float = Field(description="Every check before any rank: files, shapes, memory (the dry run on CUDA).")
    ranks_start: float = Field(description="Launching the ranks (processes, their imports, the process group) and gathering their results: the ranks' wall time beyond their phases.")
    load: dict[str, float] = Field(description="Loading, per component: transformer (the slowest rank), adapters, vaes (both, in this process).")
    text: float = Field(description="The text encoder on rank 0: loading, encoding, the broadcast to the ranks.")
    denoise: float = Field(description="The sampling loop and the latents' gather (the slowest rank).")
    parity: float = Field(0.0, description="With --parity: the one-rank reference run.")
    decode: float = Field(0.0, description="The VAE decodes (video and audio); decoded on the ranks, also the tiles' transfer and blend, and rank 0's mp4 and preview encoding.")
    write: float = Field(description="The files: video.mp4 and the preview (their encoding too when decoded in this process), the latents and the report.")
    total: float = Field(description="The process's start (or the run's, where unknown) to the report written.")

    def line(self) -> str:
        loads = " · ".join(f"{name} {seconds:.2f}s" for name, seconds in self.load.items())
        start = "?" if self.start is None else f"{self.start:.2f}s"
        return (f"{self.total:.2f}s: start {start} · checks {self.resolve:.2f}s · ranks' start {self.ranks_start:.2f}s · load {loads} · "
                f"text {self.text:.2f}s · denoise {self.denoise:.2f}s" + (f" · parity {self.parity:.2f}s" if self.parity else "") + f" · decode {self.decode:.2f}s · write {self.write:.2f}s")


class WallClock:
    """Marks the end of each stage of a run (`mark(name)`), from the run's start."""

    def __init__(self) -> None:
        self.age_at_start = process_age()
        self.began = time.perf_counter()
        self.marks: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        self.marks[stage] = time.perf_counter()

    def split(self, timings: dict[str, float], decode: dict[str, float] | None = None) -> WallTime:
        """The run's `WallTime` now, from its marks (`resolve`, `ranks`, `decode` and `parity` where run), the
        ranks' `timings` and the decode's seconds (load_s, video_s, audio_s)."""
        now = time.perf_counter()
        resolved = self.marks.get("resolve", self.began)
        ranks_done = self.marks.get("ranks", resolved)
        phases = {"transformer": timings.get("load", 0.0)} | ({"adapters": timings["adapters"]} if timings.get("adapters") else {})
        text, denoise = timings.get("text_encode", 0.0), timings.get("sampling", 0.0) + timings.get("gather", 0.0)
        ranks_start = max(0.0, ranks_done - resolved - sum(phases.values()) - text - denoise)
        decode = decode or {}
        if decode:
            phases["vaes"] = decode.get("load_s", 0.0)
        decode_end = self.marks.get("decode")  # decoded on the ranks (`run_ranks`): before the parity run and the files
        decode_wall = decode_end - ranks_done if decode_end is not None else decode.get("load_s", 0.0) + decode.get("video_s", 0.0) + decode.get("audio_s", 0.0)
        decoded = max(0.0, decode_wall - decode.get("load_s", 0.0))
        after = decode_end if decode_end is not None else ranks_done
        parity = self.marks["parity"] - after if "parity" in self.marks else 0.0
        write = max(0.0, now - after - parity - (decode_wall if decode_end is None else 0.0))
        return WallTime(
            start=self.age_at_start, resolve=resolved - self.began, ranks_start=ranks_start, load=phases, text=text,
            denoise=denoise, parity=parity, decode=decoded, write=write, total=(now - self.began) + (self.age_at_start or 0.0),
        )
