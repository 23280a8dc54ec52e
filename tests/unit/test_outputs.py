"""h3core.reports.outputs: a run's files appear together or not at all, in a place no other run writes to."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from h3core.errors import ConfigError, OutputError
from h3core.reports import outputs as out
from h3core.reports.outputs import Outputs


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _results(folder: Path, command: str = "generate") -> Path:
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"command": command}))
    (folder / "latents.safetensors").write_bytes(b"old")
    return folder


def test_files_appear_together_only_when_published(tmp_path):
    target = tmp_path / "runs" / "a"
    with Outputs() as outputs:
        folder = outputs.folder(target, kind="generate")
        bench = outputs.file(tmp_path / "bench.json", flag="--benchmark")
        assert folder.write("report.json", b"{}") == target / "report.json"  # the path it will have
        folder.write("cell/report.json", b"{}")
        bench.write(b"{}")
        assert not target.exists() and not (tmp_path / "bench.json").exists()  # nothing visible yet
        outputs.publish()
    assert _entries(target) == ["cell", "report.json"] and (tmp_path / "bench.json").read_bytes() == b"{}"
    assert _entries(tmp_path) == ["bench.json", "runs"]  # no staging, no lock left beside them
    assert _entries(tmp_path / "runs") == ["a"]


def test_leaving_without_publishing_leaves_nothing(tmp_path):
    target = tmp_path / "new" / "deeper" / "run"
    with pytest.raises(KeyboardInterrupt):
        with Outputs() as outputs:
            outputs.folder(target, kind="generate").write("latents.safetensors", b"x" * 1000)
            raise KeyboardInterrupt
    assert _entries(tmp_path) == []  # also the parents it had to create are gone


def test_an_existing_empty_folder_is_used(tmp_path):
    (tmp_path / "made").mkdir()
    with Outputs() as outputs:
        outputs.folder(tmp_path / "made", kind="generate").write("report.json", b"{}")
        outputs.publish()
    assert _entries(tmp_path / "made") == ["report.json"]


def test_a_folder_with_another_runs_results_is_never_mixed_into(tmp_path):
    old = _results(tmp_path / "run")
    with pytest.raises(ConfigError, match="already holds files .*--overwrite to replace it whole"):
        Outputs().folder(old, kind="generate")
    with Outputs() as outputs:  # --overwrite replaces it whole: nothing of the old run stays
        outputs.folder(old, kind="generate", overwrite=True).write("report.json", b'{"new": 1}')
        outputs.publish()
    assert _entries(old) == ["report.json"] and json.loads((old / "report.json").read_text()) == {"new": 1}
    assert _entries(tmp_path) == ["run"]


def test_overwrite_never_deletes_a_folder_h3_did_not_write(tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "holiday.jpg").write_bytes(b"jpeg")
    with pytest.raises(ConfigError, match="not a folder of h3 results"):
        Outputs().folder(mine, kind="generate", overwrite=True)
    assert _entries(mine) == ["holiday.jpg"]


@pytest.mark.parametrize("given", ["", "."])
def test_an_empty_output_or_the_current_folder_is_refused(given, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--output is empty"):
        Outputs().folder(Path(given), kind="generate")


def test_the_current_folder_or_one_above_it_is_refused(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ConfigError, match="current folder or one above it"):
        Outputs().folder(tmp_path, kind="generate")


def test_things_in_the_way_are_named(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        Outputs().folder(tmp_path / "file", kind="generate")
    with pytest.raises(ConfigError, match="is a FIFO"):
        Outputs().folder(tmp_path / "fifo", kind="generate")
    with pytest.raises(ConfigError, match=r"--benchmark .*dir is a folder; give a file path"):
        Outputs().file(tmp_path / "dir", flag="--benchmark")
    with pytest.raises(ConfigError, match="file is not a folder"):
        Outputs().folder(tmp_path / "file" / "sub", kind="generate")


def test_a_second_writer_to_the_same_place_is_refused_at_once(tmp_path):
    with Outputs() as first:
        first.folder(tmp_path / "run", kind="generate")
        with pytest.raises(ConfigError, match=rf"another h3 run \(pid {os.getpid()}\) is writing to .*run right now"):
            Outputs().folder(tmp_path / "run", kind="generate")
    with Outputs() as second:  # released: the next run may have it
        second.folder(tmp_path / "run", kind="generate")


def test_default_names_never_collide():
    names = {out.default_folder("generate-ulysses-1") for _ in range(50)}
    assert len(names) == 50 and all(n.parent == Path("outputs") for n in names)


def test_staging_left_by_a_killed_run_is_cleared(tmp_path):
    (tmp_path / ".run.h3-staging-99999-dead").mkdir()
    with Outputs() as outputs:
        outputs.folder(tmp_path / "run", kind="generate").write("report.json", b"{}")
        outputs.publish()
    assert _entries(tmp_path) == ["run"]


def test_too_little_free_space_is_found_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(out, "free_bytes", lambda folder: 10 << 20)
    with pytest.raises(ConfigError, match=r"writes about 513 MiB but only 10 MiB are free there"):
        Outputs().folder(tmp_path / "run", kind="generate", need_bytes=512 << 20)
    assert _entries(tmp_path) == []


@pytest.mark.parametrize("code, words", [(errno.EROFS, "the file system is read-only"), (errno.EACCES, "permission denied")])
def test_an_unwritable_place_is_one_line_before_the_run(tmp_path, monkeypatch, code, words):
    def refuse(path, data):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(out, "write_atomic", refuse)  # the probe is the first write
    with pytest.raises(ConfigError, match=f"cannot write to .*run \\(--output\\): {words}; choose another --output"):
        Outputs().folder(tmp_path / "run", kind="generate")
    assert _entries(tmp_path) == []


def test_a_full_disk_while_writing_leaves_nothing(tmp_path, monkeypatch):
    with Outputs() as outputs:
        folder = outputs.folder(tmp_path / "run", kind="generate")
        folder.write("latents.safetensors", b"x")

        def full(path, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(out, "write_atomic", full)
        with pytest.raises(OutputError, match=r"cannot write .*report.json: no space left on the device; nothing was written"):
            folder.write("report.json", b"{}")
    assert _entries(tmp_path) == []


def test_a_copy_that_cannot_be_placed_rolls_the_folder_back(tmp_path, monkeypatch):
    real_replace = os.replace

    def refuse_the_copy(src, dst):
        if Path(dst).name == "bench.json":
            raise OSError(errno.EISDIR, "Is a directory")
        return real_replace(src, dst)

    with Outputs() as outputs:
        outputs.folder(tmp_path / "run", kind="generate").write("report.json", b"{}")
        outputs.file(tmp_path / "bench.json", flag="--benchmark").write(b"{}")
        monkeypatch.setattr(out.os, "replace", refuse_the_copy)
        with pytest.raises(OutputError, match="bench.json: it is a folder; nothing was written"):
            outputs.publish()
    assert _entries(tmp_path) == []  # the folder published first was taken back


def test_a_run_never_publishes_twice_into_a_copy_of_the_lock(tmp_path):
    # The lock file is removed while held: a later run locks a fresh file, never one a third run holds.
    with Outputs() as a:
        a.folder(tmp_path / "run", kind="generate")
        assert (tmp_path / ".run.h3-lock").read_text() == str(os.getpid())
    assert not (tmp_path / ".run.h3-lock").exists()


def test_a_copy_inside_the_output_folder_is_published_with_it(tmp_path):
    with Outputs() as outputs:
        folder = outputs.folder(tmp_path / "run", kind="generate")
        copy = outputs.file(tmp_path / "run" / "copies" / "bench.json", flag="--benchmark")
        folder.write("report.json", b"{}")
        assert copy.write(b"{}") == tmp_path / "run" / "copies" / "bench.json"
        outputs.publish()
    assert _entries(tmp_path / "run") == ["copies", "report.json"] and _entries(tmp_path) == ["run"]


# --- lock files and temp files are never written through a link -------------------------------------------


@pytest.mark.parametrize("kind", ["link to a file", "dangling link", "FIFO", "folder"])
def test_a_lock_name_holding_something_else_is_refused_and_never_written_through(tmp_path, kind):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = tmp_path / ".run.h3-lock"
    if kind == "link to a file":
        lock.symlink_to(victim)
    elif kind == "dangling link":
        lock.symlink_to(tmp_path / "made-by-the-lock")
    elif kind == "FIFO":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    for make in (lambda: Outputs().folder(tmp_path / "run", kind="generate"),
                 lambda: out.ResultsFolder(tmp_path / "run", "--output", "batch.json")):
        with pytest.raises(ConfigError) as err:
            make()
        assert f"h3's lock file {lock} is" in str(err.value) and "\n" not in str(err.value)
    assert victim.read_text() == "precious" and not (tmp_path / "made-by-the-lock").exists()
    assert not (tmp_path / "run").exists()


def test_the_atomic_writer_never_writes_through_a_link_planted_under_its_temp_name(tmp_path, monkeypatch):
    from h3core.files import atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: "beef")
    (tmp_path / f".report.json.{os.getpid()}-beef.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        atomic.write_atomic(tmp_path / "report.json", b"{}")
    assert victim.read_text() == "precious" and not (tmp_path / "report.json").exists()


def test_a_results_folder_knows_when_it_was_deleted_or_replaced(tmp_path):
    folder = out.ResultsFolder(tmp_path / "b", "--output", "batch.json")
    try:
        folder.write_index(b"{}")
        folder.check_intact()
        (tmp_path / "b").rename(tmp_path / "moved")
        (tmp_path / "b").mkdir()  # another folder under its name
        for act in (folder.check_intact, lambda: folder.write_index(b"{}"), lambda: folder.entry("000-x")):
            with pytest.raises(OutputError, match="was deleted or replaced while the command ran"):
                act()
        assert _entries(tmp_path / "b") == []  # nothing written into the impostor
    finally:
        folder.close()


def test_a_results_folder_refuses_an_entry_the_disk_cannot_hold(tmp_path, monkeypatch):
    from h3core.errors import NoRoom

    folder = out.ResultsFolder(tmp_path / "b", "--output", "batch.json")
    try:
        monkeypatch.setattr(out, "free_bytes", lambda path: out.MARGIN_BYTES + 10)
        folder.check_room(10)
        with pytest.raises(NoRoom, match="only 1 MiB are free there and the next result needs about"):
            folder.entry("000-x", need_bytes=11)
        assert _entries(tmp_path / "b") == []
    finally:
        folder.close()
