"""Typed errors a user can cause, and the exit code each one maps to.

The CLI turns every `H3Error` into one line on stderr and its `exit_code`; anything else is a
bug and keeps its traceback. Messages say what went wrong *and* what to do about it.
"""

from __future__ import annotations


class H3Error(Exception):
    """A failure with a message meant for the user. Exit code 1: something failed at run time."""

    exit_code = 1


class ConfigError(H3Error):
    """The request cannot be run as given (flag, environment variable, count, shape). Exit 2."""

    exit_code = 2


class PartitionError(ConfigError):
    """A partition would leave a rank empty or cut an NVFP4 block."""


class LayoutError(ConfigError):
    """A rank count that does not split into the asked-for groups (replicas, CFG halves)."""


class CheckpointError(ConfigError):
    """A checkpoint (or text encoder) file is missing, truncated or does not match the contract."""


class KeyframeError(ConfigError):
    """A keyframe image that cannot be used: missing, unreadable, not a PNG/JPEG/WebP image, too many
    pixels, an aspect ratio outside 1:4..4:1, a role other than first/last, or a text encoder without
    the vision tower keyframes need."""


class NVFP4FormatError(ConfigError):
    """Tensors that do not follow the NVFP4 layout (shapes, dtypes, block alignment)."""


class AdapterError(ConfigError):
    """A LoRA adapter that h3 cannot apply to this model (unknown format, keys of another model,
    shapes that do not fit, non-finite weights, a bad scale); found before any rank starts. Exit 2."""


class BackendUnavailable(ConfigError):
    """An attention backend or device that was asked for is not usable on this machine."""


class RankFailure(H3Error):
    """A distributed worker raised or died; carries the failing rank's message."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.message = message

    def __reduce__(self):  # picklable across processes despite the two-argument constructor
        return (type(self), (self.rank, self.message))


class ResourceLimit(ConfigError):
    """A run needs more than this machine has (memory, ranks); found before any rank starts."""


class OutputError(H3Error):
    """Results could not be written (disk full, read-only, a file in the way) once the run had
    finished; nothing partial is left behind. (Found before the run, the same problem is a ConfigError.)"""


class NoRoom(OutputError):
    """Results could not be written because the disk is full or the quota is reached: what comes
    next cannot be written either (a batch stops instead of computing prompts it must discard)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout`, docker, SLURM and systemd send to stop a command), raised by the
    CLI's handler where Ctrl-C raises `KeyboardInterrupt`: being one, every cleanup a Ctrl-C runs
    (staging removed, lock released, ranks stopped, finished cells and prompts kept) runs for a
    SIGTERM too, and only the words and the exit code differ (`Interrupted.by`)."""


class Interrupted(H3Error):
    """The user stopped the command (Ctrl-C: exit 130; SIGTERM: exit 143); the message says what
    was and was not written."""

    exit_code = 130

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # picklable with its exit code
        return (type(self), (str(self), self.exit_code))

    @classmethod
    def by(cls, stop: BaseException, what: str) -> "Interrupted":
        """'interrupted (Ctrl-C)<what>' (exit 130), or 'interrupted (SIGTERM)<what>' (exit 143) when
        `stop` is a `Terminated`."""
        return cls(f"interrupted ({stop_name(stop)}){what}", 143 if isinstance(stop, Terminated) else 130)


def stop_name(stop: BaseException) -> str:
    """How the user stopped the command, in words: 'Ctrl-C' or 'SIGTERM'."""
    return "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"


class NonFiniteResult(H3Error):
    """A computed value (a latent) became NaN or infinite; the run stops at the step it happened."""


class DryRunFailed(H3Error):
    """The dry run of a rank's code (`h3core.generate.dryrun`) did not finish: its one line says which
    rank, what and where. A run's memory check then says so and falls back to the formula."""


class CheckFailed(H3Error):
    """A validation or parity check ran and did not meet its tolerance."""


class RemoteAPIError(H3Error):
    """An HTTP API (RunPod) answered with an error or could not be reached."""


class NoCapacity(H3Error):
    """A cloud provider reports no stock for what was asked (GPU type, count, data center)."""
