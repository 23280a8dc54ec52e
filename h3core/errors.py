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


class NVFP4FormatError(ConfigError):
    """Tensors that do not follow the NVFP4 layout (shapes, dtypes, block alignment)."""


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


class Interrupted(H3Error):
    """The user stopped the command (Ctrl-C); the message says what was and was not written."""

    exit_code = 130


class NonFiniteResult(H3Error):
    """A computed value (a latent) became NaN or infinite; the run stops at the step it happened."""


class CheckFailed(H3Error):
    """A validation or parity check ran and did not meet its tolerance."""


class RemoteAPIError(H3Error):
    """An HTTP API (RunPod) answered with an error or could not be reached."""


class NoCapacity(H3Error):
    """A cloud provider reports no stock for what was asked (GPU type, count, data center)."""
