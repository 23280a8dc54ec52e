"""The server's jobs in SQLite (the standard library's `sqlite3`): one file, `<state-dir>/jobs.sqlite3`,
in WAL mode with `synchronous=FULL`, so that a job the server answered for is on disk, and a server
killed at any moment (`kill -9`) finds every job again when it starts (`recover`):

- `completed`: its folder was published whole before the row said so; still downloadable;
- `queued`: runs;
- `in_progress` (the one the crash interrupted): back to `queued`, run again from the start; the
  staging folder it had is removed when its folder is made again (`h3core.reports.outputs`), so
  partial files are never served. A job interrupted `MAX_ATTEMPTS` times is `failed` instead;
- `deleted`: its files are removed (a delete the crash interrupted is finished).

One connection, serialized by a lock: the HTTP threads and the engine share it. Every change is one
transaction. A file that is not a whole h3 queue (garbage bytes, a truncated or damaged file,
another program's database, a folder, a read-only file) stops the server with one line naming it
(`open_jobs_database`); it is never reset, since it may hold jobs.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from h3core.errors import ConfigError
from h3core.files.paths import path_kind

DB_NAME = "jobs.sqlite3"
MAX_ATTEMPTS = 3
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  seq INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT UNIQUE NOT NULL,
  created_at REAL NOT NULL,
  status TEXT NOT NULL,
  request TEXT NOT NULL,
  inputs TEXT NOT NULL,
  model TEXT NOT NULL,
  size TEXT NOT NULL,
  seconds TEXT NOT NULL,
  steps INTEGER,
  frames INTEGER,
  seed INTEGER,
  progress INTEGER NOT NULL DEFAULT 0,
  error_code TEXT,
  error_message TEXT,
  folder TEXT,
  attempts INTEGER NOT NULL DEFAULT 0,
  replica INTEGER,
  claimed_at REAL,
  first_step_at REAL,
  completed_at REAL,
  denoise_seconds REAL,
  decode_seconds REAL
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq);
"""
STATUSES = ("queued", "in_progress", "completed", "failed", "deleted")


@dataclass
class Recovered:
    """What `recover` found when the server started."""

    requeued: list[str]
    failed: list[str]
    completed: int
    missing: list[str]
    deleted: list[str]


COLUMNS = frozenset(re.findall(r"^  (\w+) ", _SCHEMA, flags=re.MULTILINE))
"""The jobs table's columns, as `_SCHEMA` makes them."""


def open_jobs_database(path: Path) -> sqlite3.Connection:
    """The queue's SQLite file, checked before anything is written to it: a file that SQLite cannot
    read, that fails its `quick_check`, that holds another program's tables or a jobs table of
    another shape, that cannot be written, or a folder in its place, is one `ConfigError` naming the
    file and what to do. Never replaced: it may hold the jobs of earlier runs."""
    if path.exists() and not path.is_file():
        raise _unusable(path, f"is {path_kind(path, follow=True)}, not h3's SQLite job queue")
    try:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
    except sqlite3.Error as err:
        raise _unusable(path, f"cannot be opened ({err})") from None
    try:
        _check_database(db, path)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
    except sqlite3.Error as err:
        db.close()
        raise _unusable(path, _sqlite_reason(err)) from None
    except BaseException:
        db.close()
        raise
    return db


def _check_database(db: sqlite3.Connection, path: Path) -> None:
    (verdict,) = db.execute("PRAGMA quick_check(1)").fetchone()
    if verdict != "ok":
        raise _unusable(path, f"is damaged (SQLite's quick_check: {' '.join(str(verdict).split())[:200]})")
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if tables - {"sqlite_sequence"} and "jobs" not in tables:
        raise _unusable(path, f"is a SQLite database of something else (tables {', '.join(sorted(tables)[:5])})")
    if "jobs" in tables:
        columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        if not COLUMNS <= columns:
            raise _unusable(path, f"has a jobs table without {', '.join(sorted(COLUMNS - columns)[:5])}: not h3's job queue")


def _sqlite_reason(err: sqlite3.Error) -> str:
    text = str(err)
    if "readonly" in text or "read-only" in text:
        return "cannot be written (it or its folder is read-only); make both writable"
    if "not a database" in text or "malformed" in text:
        return f"is damaged or not a SQLite database ({text})"
    return f"cannot be used ({text})"


def _unusable(path: Path, why: str) -> ConfigError:
    why = " ".join(why.split())
    return ConfigError(f"the server's job queue {path} {why}; h3 never replaces it (it holds the jobs of earlier runs): move it aside "
                       f"(mv {path} {path}.broken) to start with an empty queue, or give another --state-dir")


class JobQueue:
    """The jobs table (module docstring). Rows are dicts of the columns."""

    def __init__(self, state_dir: Path):
        self.path = Path(state_dir) / DB_NAME
        self._lock = threading.Lock()
        self._db = open_jobs_database(self.path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- one transaction each ----------------------------------------------------------------------------

    def _write(self, sql: str, args: tuple = ()) -> int:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                count = self._db.execute(sql, args).rowcount
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return count

    def _read(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(row) for row in self._db.execute(sql, args).fetchall()]

    # -- the API's side ------------------------------------------------------------------------------------

    def add(self, job: dict[str, Any], max_queued: int) -> bool:
        """Insert a queued job unless `max_queued` jobs are queued already (False then)."""
        columns = ", ".join(job)
        marks = ", ".join("?" for _ in job)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (queued,) = self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()
                if queued >= max_queued:
                    self._db.execute("ROLLBACK")
                    return False
                self._db.execute(f"INSERT INTO jobs ({columns}, status) VALUES ({marks}, 'queued')", tuple(job.values()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def get(self, job_id: str) -> dict[str, Any] | None:
        """A job that is not deleted."""
        rows = self._read("SELECT * FROM jobs WHERE id = ? AND status != 'deleted'", (job_id,))
        return rows[0] if rows else None

    def page(self, limit: int, after: str | None, newest_first: bool) -> tuple[list[dict[str, Any]], bool] | None:
        """Up to `limit` jobs after the job `after` (None when `after` is no job), and whether more follow."""
        where, args = "status != 'deleted'", []
        if after is not None:
            anchor = self._read("SELECT seq FROM jobs WHERE id = ?", (after,))
            if not anchor:
                return None
            where += " AND seq < ?" if newest_first else " AND seq > ?"
            args.append(anchor[0]["seq"])
        order = "DESC" if newest_first else "ASC"
        rows = self._read(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {order} LIMIT ?", (*args, limit + 1))
        return rows[:limit], len(rows) > limit

    def delete(self, job_id: str) -> dict[str, Any] | None:
        """Mark a job deleted; the row as it was (None: no such job)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT * FROM jobs WHERE id = ? AND status != 'deleted'", (job_id,)).fetchone()
                if row is not None:
                    self._db.execute("UPDATE jobs SET status = 'deleted' WHERE id = ?", (job_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return dict(row) if row is not None else None

    def counts(self) -> dict[str, int]:
        rows = self._read("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
        found = {row["status"]: row["n"] for row in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    # -- the engine's side -------------------------------------------------------------------------------------

    def claim(self, count: int) -> list[dict[str, Any]]:
        """Take up to `count` queued jobs, oldest first: they are `in_progress` from now on."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = [dict(r) for r in self._db.execute("SELECT * FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT ?", (count,)).fetchall()]
                for row in rows:
                    self._db.execute(
                        "UPDATE jobs SET status = 'in_progress', attempts = attempts + 1, claimed_at = ?, progress = 0, first_step_at = NULL WHERE id = ?",
                        (now, row["id"]),
                    )
                    row.update(status="in_progress", attempts=row["attempts"] + 1, claimed_at=now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return rows

    def running(self, job_id: str, **values: Any) -> bool:
        """Update a job that is still in progress (False: it was deleted meanwhile)."""
        sets = ", ".join(f"{name} = ?" for name in values)
        return self._write(f"UPDATE jobs SET {sets} WHERE id = ? AND status = 'in_progress'", (*values.values(), job_id)) == 1

    def finish(self, job_id: str, status: str, **values: Any) -> bool:
        """An in-progress job ends `completed`, `failed` or `queued` again (False: it was deleted meanwhile)."""
        assert status in ("completed", "failed", "queued")
        values = {"status": status, **values}
        if status != "queued":
            values.setdefault("completed_at", time.time())
        return self.running(job_id, **values)

    def requeue_running(self) -> list[str]:
        """Every in-progress job back to queued (a stop, or a crash found at start)."""
        rows = self._read("SELECT id FROM jobs WHERE status = 'in_progress'")
        self._write("UPDATE jobs SET status = 'queued', progress = 0, first_step_at = NULL, replica = NULL WHERE status = 'in_progress'")
        return [row["id"] for row in rows]

    def recover(self, folder_of: Any) -> Recovered:
        """At start (module docstring). `folder_of(id)`: the job's folder, to check completed jobs."""
        worn = self._read("SELECT id FROM jobs WHERE status = 'in_progress' AND attempts >= ?", (MAX_ATTEMPTS,))
        for row in worn:
            self.finish(row["id"], "failed", error_code="interrupted",
                        error_message=f"the server stopped while this job ran, {MAX_ATTEMPTS} times; submit it again")
        requeued = self.requeue_running()
        missing = []
        completed = self._read("SELECT id FROM jobs WHERE status = 'completed'")
        for row in completed:
            if not (folder_of(row["id"]) / "video.mp4").is_file():
                missing.append(row["id"])
                self._write("UPDATE jobs SET status = 'failed', error_code = 'files_missing', error_message = ? WHERE id = ?",
                            ("its files are no longer in the server's state directory", row["id"]))
        deleted = [row["id"] for row in self._read("SELECT id FROM jobs WHERE status = 'deleted'")]
        return Recovered(requeued=requeued, failed=[r["id"] for r in worn], completed=len(completed) - len(missing), missing=missing, deleted=deleted)

    def ids(self, status: str) -> Iterator[str]:
        for row in self._read("SELECT id FROM jobs WHERE status = ?", (status,)):
            yield row["id"]
