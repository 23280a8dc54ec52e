"""Where a command's results go: checked before any rank starts, staged privately, published whole.

Every command that writes results (`generate`, `matrix`, `verify`, `bench-transport`, and the
`--benchmark` copies) writes them through one `Outputs`:

1. `folder(path)` / `file(path)` check the location before anything runs: a path that is not
   empty and not the current folder, no file where a folder goes (nor a folder where a file goes),
   a parent that can be created and written (a probe file is written, synced and removed), free
   space for what the run will write. A folder that already holds files is refused: h3 never mixes
   one run's files into another's. `overwrite=True` replaces a folder of h3 results whole (and
   only one of those: h3 never deletes a folder it did not write).
2. A lock (`.NAME.h3-lock` beside the target, `flock`; opened with `O_NOFOLLOW`, a regular file
   or refused) is held from the check until the end: a second run into the same place is refused
   at once instead of racing the first.
3. Files are written into a private staging folder beside the target (`.NAME.h3-staging-PID-XX`),
   each through the one atomic writer (`h3core.files.atomic`): whole at every moment.
4. `publish()` renames the staging folder onto the target (atomic; `rename` replaces an empty
   folder), then moves single files into place. If a later step fails the earlier are rolled back.
   Until then nothing exists under the target's name; after it, every file does.
5. Leaving the `with` block without publishing (an error, a failed rank, Ctrl-C or SIGTERM) removes the
   staging folder and the lock: nothing was written.

Default folder names (`outputs/<UTC time to the microsecond>-<what>-<4 hex>`) cannot collide
between runs started at the same moment. Every `OSError` (read-only, full, permission, a file in
the way) becomes one line: a `ConfigError` when found by the check, an `OutputError` when writing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
from datetime import datetime, timezone
from pathlib import Path

from h3core.errors import ConfigError, H3Error, Interrupted, NoRoom, OutputError
from h3core.files.atomic import write_atomic
from h3core.files.paths import free_bytes, os_error_reason, path_kind
from h3core.files.text import read_json
from h3core.reports.units import format_bytes

REPORT_FILES = ("report.json", "matrix.json", "verify.json", "batch.json")
"""A folder holding one of these at its top is a folder of h3 results (what `overwrite` may replace)."""

PROBE_BYTES = 4096
MARGIN_BYTES = 1 << 20  # report, preview and file-system overhead on top of a target's own estimate
_LOCK, _STAGING, _REPLACED = ".h3-lock", ".h3-staging-", ".h3-replaced-"


def default_folder(kind: str) -> Path:
    """`outputs/<UTC time to the microsecond>-<kind>-<4 hex>`: distinct for runs started together."""
    now = datetime.now(timezone.utc)
    return Path("outputs") / f"{now:%Y%m%dT%H%M%S}.{now:%f}Z-{kind}-{secrets.token_hex(2)}"


class _Lock:
    """An exclusive `flock` on `.NAME.h3-lock` beside `target`, taken without waiting.

    The lock file is opened without following a symbolic link and must be a regular file: a link
    planted under its name (or a FIFO, a device) is refused in one line, never written through."""

    def __init__(self, target: Path, flag: str):
        self.path = target.parent / f".{target.name}{_LOCK}"
        while True:
            fd = self._open(flag)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise ConfigError(
                    f"another h3 run{f' (pid {holder})' if holder else ''} is writing to {target} right now; "
                    f"wait for it to finish or choose another {flag}"
                ) from None
            try:
                same = os.lstat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False  # the previous holder removed it as we locked it: lock the new one
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd: int | None = fd

    def _open(self, flag: str) -> int:
        refuse = f"choose another {flag}, or remove {self.path} if no h3 run is writing there"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise ConfigError(f"h3's lock file {self.path} is a symbolic link (h3 never makes one there); {refuse}") from None
            if err.errno == errno.EISDIR:
                raise ConfigError(f"h3's lock file {self.path} is a folder, not a file; {refuse}") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"h3's lock file {self.path} is {path_kind(self.path)}, not a file; {refuse}")
        return fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still holding it: see the inode check above
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


class _Target:
    """One place results go: checked, locked and staged when made; published or discarded later."""

    def __init__(self, path: Path, flag: str, need_bytes: int):
        self.path, self.flag = Path(path), flag
        self._made_parents: list[Path] = []
        self._lock: _Lock | None = None
        self.staging: Path | None = None
        self.published = False
        self._check_name()
        try:
            self._make_parents()
            self._check_existing()
            self._lock = _Lock(self.path, flag)
            self._clear_stale_staging()
            self.staging = self._stage()
            self._probe(need_bytes)
        except OSError as err:
            self.discard()
            raise ConfigError(f"cannot write to {self.path} ({flag}): {os_error_reason(err)}; choose another {flag}") from None
        except BaseException:
            self.discard()
            raise

    # -- the checks ---------------------------------------------------------------------------------

    def _check_name(self) -> None:
        _check_not_here(self.path, self.flag)

    def _make_parents(self) -> None:
        missing = []
        parent = self.path.parent
        while not parent.exists() and parent != parent.parent:
            missing.append(parent)
            parent = parent.parent
        for folder in reversed(missing):
            folder.mkdir()
            self._made_parents.append(folder)
        if not self.path.parent.is_dir():
            raise ConfigError(f"{self.flag} {self.path}: {self.path.parent} is not a folder; choose another {self.flag}")

    def _check_existing(self) -> None:  # pragma: no cover - each target says what may already be there
        raise NotImplementedError

    def _clear_stale_staging(self) -> None:
        """Staging left by a run that was killed before it could clean up (we hold the lock: none is live)."""
        for leftover in self.path.parent.glob(f".{self.path.name}{_STAGING}*"):
            _remove(leftover)

    def _stage(self) -> Path:
        staging = self.path.parent / f".{self.path.name}{_STAGING}{os.getpid()}-{secrets.token_hex(2)}"
        staging.mkdir()
        return staging

    def _probe(self, need_bytes: int) -> None:
        """Write, sync and remove a small file where the results will go; check the free space."""
        assert self.staging is not None
        _probe_room(self.staging, need_bytes, self.flag, self.path)

    # -- the end ----------------------------------------------------------------------------------------

    def publish(self) -> None:
        raise NotImplementedError

    def unpublish(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        """Remove the staging (and the parents this target created, when empty) and release the lock."""
        if self.staging is not None and not self.published:
            _remove(self.staging)
            self.staging = None
        self.release()
        if not self.published:
            for folder in reversed(self._made_parents):
                try:
                    folder.rmdir()
                except OSError:
                    break

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


class OutputFolder(_Target):
    """A folder that belongs to one run: staged privately, then renamed into place whole."""

    def __init__(self, path: Path, flag: str, need_bytes: int = 0, overwrite: bool = False):
        self.overwrite = overwrite
        self._replaced: Path | None = None
        super().__init__(path, flag, need_bytes)

    def _check_existing(self) -> None:
        path = self.path
        if not path.exists() and not path.is_symlink():
            return
        if not path.is_dir() or path.is_symlink():
            raise ConfigError(f"{self.flag} {path} is {path_kind(path)}, not a folder; choose a new folder name")
        entries = sorted(p.name for p in path.iterdir())
        if not entries:
            return  # an empty folder made for this run: the publishing rename replaces it
        if not self.overwrite:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ConfigError(
                f"{self.flag} {path} already holds files ({shown}); h3 does not mix one run's results into another's: "
                f"choose a new folder{' or pass --overwrite to replace it whole' if _is_results(path) else ''}"
            )
        if not _is_results(path):
            raise ConfigError(
                f"{self.flag} {path} is not a folder of h3 results (no {' / '.join(REPORT_FILES)}); --overwrite only "
                "replaces h3's own results: choose a new folder"
            )

    def write(self, name: str | Path, data: bytes) -> Path:
        """Stage `data` as `name` (may hold subfolders) and return the path it will have once published."""
        assert self.staging is not None, "this output folder was already published or discarded"
        try:
            write_atomic(self.staging / name, data)  # a file rewritten (matrix.json after every cell) is whole at every moment
        except OSError as err:
            raise output_error(f"cannot write {self.path / name}", err, "nothing was written") from None
        return self.path / name

    def publish(self) -> None:
        assert self.staging is not None
        _sync_folder(self.staging)
        if self.overwrite and self.path.exists() and any(self.path.iterdir()):
            self._replaced = self.path.parent / f".{self.path.name}{_REPLACED}{secrets.token_hex(2)}"
            os.rename(self.path, self._replaced)
        try:
            os.rename(self.staging, self.path)  # replaces an empty folder; never a full one
        except OSError:
            if self._replaced is not None:
                os.rename(self._replaced, self.path)
                self._replaced = None
            raise
        self.published = True
        _sync_folder(self.path.parent)

    def unpublish(self) -> None:
        """Undo `publish` (a later target failed): the results go back to staging, the old ones back."""
        assert self.staging is not None
        os.rename(self.path, self.staging)
        if self._replaced is not None:
            os.rename(self._replaced, self.path)
            self._replaced = None
        self.published = False

    def finish(self) -> None:
        """After every target is published: drop what `overwrite` replaced, release the lock."""
        if self._replaced is not None:
            _remove(self._replaced)
            self._replaced = None
        self.release()


class OutputFile(_Target):
    """One file (a report copy): staged beside its place, then renamed over it."""

    def __init__(self, path: Path, flag: str, need_bytes: int = 0):
        self._data: bytes | None = None
        super().__init__(path, flag, need_bytes)

    def _check_existing(self) -> None:
        if self.path.is_dir():
            raise ConfigError(f"{self.flag} {self.path} is a folder; give a file path, e.g. {self.flag} {self.path / 'report.json'}")
        if self.path.exists() and not self.path.is_file():
            raise ConfigError(f"{self.flag} {self.path} is {path_kind(self.path)}, not a file; give a file path")

    def write(self, data: bytes) -> Path:
        """Stage the file's content; returns the path it will have."""
        assert self.staging is not None
        try:
            write_atomic(self.staging / self.path.name, data)
        except OSError as err:
            raise output_error(f"cannot write {self.path}", err, "nothing was written") from None
        self._data = data
        return self.path

    def publish(self) -> None:
        assert self.staging is not None
        if self._data is None:
            raise OutputError(f"nothing was staged for {self.path}; nothing was written")
        os.replace(self.staging / self.path.name, self.path)
        self.published = True
        _remove(self.staging)
        _sync_folder(self.path.parent)

    def unpublish(self) -> None:  # files are published last: nothing after them can fail
        raise AssertionError("an OutputFile is never rolled back")

    def finish(self) -> None:
        self.release()


class FileInFolder:
    """A single-file output that lies inside an output folder (`-o run --benchmark run/b.json`)."""

    def __init__(self, folder: OutputFolder, relative: Path):
        self.folder, self.relative = folder, relative
        self.path = folder.path / relative

    def write(self, data: bytes) -> Path:
        return self.folder.write(self.relative, data)


class ResultsFolder:
    """A folder that fills entry by entry (`h3 generate --prompts`): each entry an `OutputFolder`
    published whole as soon as it is done, and an index file (`index`) rewritten atomically after
    each, so that what an interrupted command finished stays and the index is current.

    Checked and locked for the whole command like any target. An existing folder is taken only when
    it is empty or holds `index` (the same command run again: `resumed`); anything else is refused.
    Nothing is staged at this level: the folder is made at once, and `close` only releases the lock.

    While the command runs the folder must stay the one it made or took: each entry and index
    write first checks that it still is (`check_intact`: a folder deleted or replaced mid-run is an
    `OutputError`, never silently made again), and `check_room` tells before an entry is computed
    whether the disk can still hold it (`NoRoom` when not).
    """

    def __init__(self, path: Path, flag: str, index: str, need_bytes: int = 0):
        self.path, self.flag, self.index = Path(path), flag, index
        self._lock: _Lock | None = None
        _check_not_here(self.path, flag)
        try:
            self.resumed = self._check_existing()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = _Lock(self.path, flag)
            self.path.mkdir(exist_ok=True)
            self._identity = _identity(self.path)
            _probe_room(self.path, need_bytes, flag, self.path)
        except OSError as err:
            self.close()
            raise ConfigError(f"cannot write to {self.path} ({flag}): {os_error_reason(err)}; choose another {flag}") from None
        except BaseException:
            self.close()
            raise

    def _check_existing(self) -> bool:
        path = self.path
        if not path.exists() and not path.is_symlink():
            return False
        if not path.is_dir() or path.is_symlink():
            raise ConfigError(f"{self.flag} {path} is {path_kind(path)}, not a folder; choose a new folder name")
        if (path / self.index).is_file():
            return True
        entries = sorted(p.name for p in path.iterdir())
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ConfigError(
                f"{self.flag} {path} already holds files ({shown}) and no {self.index}: it is not a folder this command wrote, "
                "and h3 does not mix results into it; choose a new folder"
            )
        return False

    def read_index(self, limit: int = 64 << 20) -> object:
        """The index file's JSON (None when absent or not JSON h3 can read)."""
        try:
            return read_json(self.path / self.index, self.flag, limit, "it is not a folder h3 wrote")
        except ConfigError:
            return None

    def clear(self) -> None:
        """Replace the folder by an empty one (`--overwrite`: the old results go whole)."""
        self.check_intact()
        replaced = self.path.parent / f".{self.path.name}{_REPLACED}{secrets.token_hex(2)}"
        try:
            os.rename(self.path, replaced)
            self.path.mkdir()
            self._identity = _identity(self.path)
        except OSError as err:
            raise ConfigError(f"cannot replace {self.path} ({self.flag} with --overwrite): {os_error_reason(err)}") from None
        _remove(replaced)
        self.resumed = False

    def check_intact(self) -> None:
        """The folder is still the one this command made or took (not deleted, moved or replaced)."""
        try:
            same = _identity(self.path) == self._identity
        except OSError:
            same = False
        if not same:
            raise OutputError(
                f"{self.flag} {self.path} was deleted or replaced while the command ran: the results it held are gone "
                "from there; run the same command again to redo them"
            )

    def check_room(self, need_bytes: int) -> None:
        """`NoRoom` unless the disk holding the folder has room for `need_bytes` more (and the margin)."""
        self.check_intact()
        need, free = need_bytes + MARGIN_BYTES, free_bytes(self.path)
        if free < need:
            raise NoRoom(
                f"{self.flag} {self.path}: only {format_bytes(free)} are free there and the next result needs about "
                f"{format_bytes(need)}; free some space and run the same command again to go on"
            )

    def entry(self, name: str, need_bytes: int = 0, overwrite: bool = False) -> OutputFolder:
        """The subfolder `name`, staged beside itself and published whole (`overwrite`: replace an
        earlier result). Made while the command runs: what refuses it is an `OutputError` (a full
        disk: `NoRoom`), not a usage error."""
        self.check_room(need_bytes)  # (and intact: an entry would otherwise make a deleted folder again)
        try:
            return OutputFolder(self.path / name, self.flag, 0, overwrite)
        except ConfigError as err:
            raise OutputError(str(err)) from None

    def write_index(self, data: bytes) -> Path:
        """Rewrite the index file atomically (whole at every moment)."""
        self.check_intact()
        try:
            return write_atomic(self.path / self.index, data)
        except OSError as err:
            raise output_error(f"cannot write {self.path / self.index}", err, "the results already written stay") from None

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> "ResultsFolder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Outputs:
    """Every place one command writes to, published together or not at all (see the module docstring)."""

    def __init__(self, enabled: bool = True):
        """`enabled=False`: a torchrun rank other than 0, which writes nothing and reserves nothing."""
        self.enabled = enabled
        self._folders: list[OutputFolder] = []
        self._files: list[OutputFile] = []
        self.published = False

    def folder(self, path: Path | None, *, kind: str, flag: str = "--output", need_bytes: int = 0, overwrite: bool = False) -> OutputFolder:
        folder = OutputFolder(path if path is not None else default_folder(kind), flag, need_bytes, overwrite)
        self._folders.append(folder)
        return folder

    def file(self, path: Path, *, flag: str, need_bytes: int = 0) -> "OutputFile | FileInFolder":
        """A single file; one inside a folder of these outputs is staged and published with that folder."""
        for folder in self._folders:
            try:
                relative = Path(path).resolve().relative_to(folder.path.resolve())
            except ValueError:
                continue
            if relative == Path("."):
                raise ConfigError(f"{flag} {path} is the output folder itself; give a file path, e.g. {flag} {Path(path) / 'report-copy.json'}")
            return FileInFolder(folder, relative)
        target = OutputFile(path, flag, need_bytes)
        self._files.append(target)
        return target

    def publish(self) -> None:
        """Folders first, then files; a failure rolls back what was already published and raises."""
        done: list[_Target] = []
        for target in [*self._folders, *self._files]:
            try:
                target.publish()
            except OSError as err:
                for earlier in reversed(done):
                    earlier.unpublish()
                raise output_error(f"cannot write {target.path}", err, "nothing was written") from None
            done.append(target)
        self.published = True
        for target in done:
            target.finish()

    def discard(self) -> None:
        for target in [*self._files, *self._folders]:
            target.discard()

    def __enter__(self) -> "Outputs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.published:
            self.discard()


def output_error(what: str, err: OSError, then: str) -> OutputError:
    """'<what>: <why>; <then>' as an `OutputError`, or a `NoRoom` when the disk is full or the quota reached."""
    kind = NoRoom if err.errno in (errno.ENOSPC, errno.EDQUOT) else OutputError
    return kind(f"{what}: {os_error_reason(err)}; {then}")


def publish_on_interrupt(outputs: Outputs, stop: BaseException, what: str) -> None:
    """Publish what was staged (a matrix's finished cells) and raise `Interrupted.by(stop, what)`
    (`stop`: the KeyboardInterrupt of a Ctrl-C, or the `Terminated` of a SIGTERM)."""
    try:
        outputs.publish()
    except H3Error as err:
        raise Interrupted.by(stop, f", and the partial results could not be written: {err}") from None
    raise Interrupted.by(stop, what)


def _check_not_here(path: Path, flag: str) -> None:
    """A target is a new name: not empty, not the current folder or one above it."""
    if str(path) in ("", "."):
        raise ConfigError(f"{flag} is empty (or '.'): give a new folder or file name, e.g. {flag} outputs/run1")
    here = Path.cwd().resolve()
    target = path.resolve()
    if target == here or target in here.parents:
        raise ConfigError(f"{flag} {path} is the current folder or one above it; give a new folder name, e.g. {flag} outputs/run1")


def _probe_room(folder: Path, need_bytes: int, flag: str, target: Path) -> None:
    """Write, sync and remove a small file in `folder`; check the free space for `need_bytes`."""
    probe = folder / ".probe"
    write_atomic(probe, b"\0" * PROBE_BYTES)
    probe.unlink()
    need = need_bytes + MARGIN_BYTES
    free = free_bytes(folder)
    if free < need:
        raise ConfigError(
            f"{flag} {target}: this run writes about {format_bytes(need)} but only "
            f"{format_bytes(free)} are free there; free some space or choose another {flag}"
        )


def _identity(path: Path) -> tuple[int, int]:
    """(device, inode) of `path` itself (a link is not followed)."""
    info = os.lstat(path)
    return info.st_dev, info.st_ino


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not sync folders; the data itself was synced
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _is_results(path: Path) -> bool:
    return any((path / name).is_file() for name in REPORT_FILES)
