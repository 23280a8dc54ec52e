"""File-system facts in words: what kind of thing a path names, and why an OSError happened.

One place for the phrasing every "cannot read/write X" line uses (outputs, checkpoints, caches).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EISDIR: "it is a folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "something already exists there",
    errno.ENOTEMPTY: "the folder is not empty",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ENOENT: "a part of the path does not exist",
    errno.EIO: "an input/output error (a failing disk?)",
}

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def os_error_reason(err: OSError) -> str:
    """'no space left on the device', 'the file system is read-only', ... (else the OS's own words)."""
    return _REASONS.get(err.errno or 0, err.strerror or type(err).__name__)


def path_kind(path: Path, follow: bool = False) -> str:
    """'a file', 'a folder', 'a FIFO (named pipe)', 'a character device', ..., or 'nothing' when absent.

    Never opens the path (a FIFO would block); `follow` describes what a symbolic link points to.
    """
    try:
        mode = (path.stat() if follow else path.lstat()).st_mode
    except FileNotFoundError:
        return "nothing"
    except OSError as err:
        return f"unreadable ({os_error_reason(err)})"
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `folder`."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize
