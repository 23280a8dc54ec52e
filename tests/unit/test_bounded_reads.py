"""Files a user names are read with a bound (`h3core.files.paths.read_bounded`): a FIFO, a device, a
socket or a folder is refused by what it is, before it is opened (a FIFO would block, /dev/zero
never ends), a file too large by its size; each is one line naming the flag, and so is every
command that reads one (`--prompts`, `--ssh-public-key`)."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from commands import one_line, run_main
from h3core.batch.prompts import MAX_FILE_BYTES, read_prompts
from h3core.errors import ConfigError
from h3core.files.paths import read_bounded
from h3core.pod.create import _MAX_KEY_BYTES, read_public_key


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a FIFO nobody writes) fails the test in 10 s instead of hanging it."""
    def hung(*_):
        raise TimeoutError("a read blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _socket(tmp_path):
    path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return path


def _link_to_zero(tmp_path):
    path = tmp_path / "zero.txt"
    path.symlink_to("/dev/zero")
    return path


def _sparse(size):
    def make(tmp_path):
        path = tmp_path / "big.txt"
        with open(path, "wb") as f:
            f.truncate(size)
        return path
    return make


NOT_FILES = {
    "/dev/zero": (lambda tmp_path: "/dev/zero", "it is a character device, not a regular file"),
    "/dev/stdin": (lambda tmp_path: "/dev/null", "it is a character device, not a regular file"),
    "FIFO": (_fifo, "it is a FIFO (named pipe), not a regular file"),
    "socket": (_socket, "it is a socket, not a regular file"),
    "folder": (lambda tmp_path: tmp_path, "it is a folder, not a regular file"),
    "link to /dev/zero": (_link_to_zero, "it is a character device, not a regular file"),
}


@pytest.mark.parametrize("case", list(NOT_FILES))
def test_what_is_not_a_regular_file_is_refused_by_what_it_is(tmp_path, case):
    make, reason = NOT_FILES[case]
    path = make(tmp_path)
    with pytest.raises(ConfigError) as err:
        read_bounded(path, "--thing", 1024, "give a file")
    assert str(err.value) == f"cannot read --thing {path}: {reason}; give a file"


def test_a_file_larger_than_the_bound_is_refused_by_its_size_and_one_at_the_bound_is_read(tmp_path):
    with pytest.raises(ConfigError, match="it is larger than 1 KiB; give a file"):
        read_bounded(_sparse(1025)(tmp_path), "--thing", 1024, "give a file")
    assert read_bounded(_sparse(1024)(tmp_path), "--thing", 1024, "give a file") == b"\0" * 1024


def test_a_file_that_says_it_is_empty_but_never_ends_stops_at_the_bound():
    # /proc files are regular files of size 0 whatever they hold: the bound holds while reading too.
    with pytest.raises(ConfigError, match="larger than 1 KiB"):
        read_bounded("/proc/self/smaps", "--thing", 1024, "give a file")


@pytest.mark.parametrize("case", [*NOT_FILES, "too large"])
def test_prompts_and_ssh_key_files_are_read_with_the_bound(tmp_path, case):
    make, _ = NOT_FILES.get(case, (None, None))
    for reader, flag, limit in ((read_prompts, "--prompts", MAX_FILE_BYTES), (read_public_key, "--ssh-public-key", _MAX_KEY_BYTES)):
        where = tmp_path / flag.strip("-")
        where.mkdir()
        path = make(where) if make else _sparse(limit + 1)(where)
        with pytest.raises(ConfigError, match=f"cannot read {flag} "):
            reader(path)


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "/dev/urandom"])
def test_the_commands_refuse_them_in_one_line(capsys, monkeypatch, tmp_path, source):
    monkeypatch.setenv("RUNPOD_API_KEY", "rpa_TESTKEY0123456789abcdefSECRET")
    monkeypatch.setenv("RUNPOD_API_BASE_URL", "http://127.0.0.1:9")  # never reached: the key file is read first
    path = str(_fifo(tmp_path)) if source == "fifo" else source
    for args in (("generate", "--prompts", path), ("pod", "create", "--ssh-public-key", path, "--yes")):
        code, out, err = run_main(capsys, *args)
        assert code == 2 and "not a regular file" in one_line(err), (args, err)
