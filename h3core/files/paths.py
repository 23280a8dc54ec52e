"""File-system facts in words: what kind of thing a path names, and why an OSError happened; and
`read_bounded`, the one way h3 reads a small file a user names (`h3core.files.text` decodes it as
text or JSON).

One place for the phrasing every "cannot read/write X" line uses (outputs, checkpoints, caches).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from h3core.errors import ConfigError

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
    except ValueError:  # a NUL byte: no file system has such a name
        return "not a valid path (it holds a NUL byte)"
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def inside(folder: Path, name: str) -> Path | None:
    """`folder / name` when `name` is a relative path that stays in `folder` (not absolute, no `..`
    part, no NUL byte), else None: how h3 takes a file name that a file it reads names (a shard
    index's shards, a VAE config's `source_path`), so that no such name leads out of its folder."""
    relative = Path(name)
    if not name or "\x00" in name or relative.is_absolute() or ".." in relative.parts:
        return None
    return folder / relative


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `folder`."""
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def read_bounded(path: Path | str, what: str, limit: int, hint: str, error: type[ConfigError] = ConfigError) -> bytes:
    """The whole content of the regular file `path`, at most `limit` bytes.

    Anything else is one `error` line (a `ConfigError`, or the subclass the caller names),
    'cannot read WHAT PATH: <why>; HINT', before a byte is read: a FIFO (which would block), a
    device (`/dev/zero` never ends), a socket or a folder is refused by what it is, without being
    opened (opening a device can have effects of its own), and checked again on the opened file (it may have been swapped in between); a file
    larger than `limit` is refused by its size, and one that grows past it while being read, at
    `limit` bytes.
    """
    path = Path(path)

    def refuse(reason: str) -> ConfigError:
        return error(f"cannot read {what} {path}: {reason}; {hint}")

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise refuse(f"it is {path_kind(path, follow=True)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        raise refuse(os_error_reason(err)) from None
    except ValueError:
        raise refuse("the path holds a NUL byte") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refuse("it is not a regular file")
        if info.st_size > limit:
            raise refuse(f"it is larger than {_size(limit)}")
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise refuse(f"it is larger than {_size(limit)}")
        return b"".join(chunks)
    except OSError as err:
        raise refuse(os_error_reason(err)) from None
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
