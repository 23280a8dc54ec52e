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


# --- text and JSON: one reader (h3core.files.text) ------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000
"""The review's case: 100,000 levels, which Python's parser meets with a RecursionError."""


@pytest.mark.parametrize("data, reason", [
    (DEEP, "JSON nested deeper than 100 levels"),
    ('{"prompt": ' + DEEP + "}", "JSON nested deeper than 100 levels"),
    ("[" * 100_000, "JSON nested deeper than 100 levels"),  # unclosed: refused by depth before the parser sees it
    ("[" * 101 + "]" * 101, "JSON nested deeper than 100 levels"),
    ('{"a":' * 101 + "1" + "}" * 101, "JSON nested deeper than 100 levels"),
    ('[{"a": [' * 40 + "]}]" * 40, "JSON nested deeper than 100 levels"),  # 120 levels, mixed
    ("9" * 5000, "a number of 5000 characters (h3 reads numbers of at most 100)"),
    ('{"seed": -' + "9" * 5000 + "}", "a number of 5001 characters"),
    ('{"guidance": 1.' + "0" * 5000 + "}", "a number of 5002 characters"),
    ('{"a": 1', "not valid JSON (Expecting ',' delimiter at line 1 column 8)"),
    ("", "not valid JSON (Expecting value at line 1 column 1)"),
    (b"\xff{}", "not UTF-8 text (byte 0)"),
    (b"\xef\xbb\xbf\xef\xbb\xbf{}", "not valid JSON (Unexpected UTF-8 BOM"),  # one mark is dropped, not two
])
def test_every_malformed_json_is_one_typed_line_naming_the_document(data, reason):
    from h3core.errors import CheckpointError
    from h3core.files.text import parse_json

    for error in (ConfigError, CheckpointError):
        with pytest.raises(error) as caught:
            parse_json(data, "model/x.json", "download it again", error=error)
        message = str(caught.value)
        assert message.startswith(f"model/x.json: {reason}") and message.endswith("; download it again") and "\n" not in message


@pytest.mark.parametrize("data, value", [
    ("[" * 100 + "]" * 100, None),  # at the bound
    ('["' + "[" * 1000 + '"]', ["[" * 1000]),  # brackets inside strings do not nest
    ('["\\"' + "[" * 1000 + '", 1]', ['"' + "[" * 1000, 1]),  # nor after an escaped quote
    ("\ufeff" + '{"a": 1}', {"a": 1}),  # a byte-order mark is not text
    (b"\xef\xbb\xbf" + b'{"a": 1}', {"a": 1}),
    ("18446744073709551615", 2**64 - 1),
    ("1e999", float("inf")),
])
def test_what_is_valid_json_within_the_bounds_is_read(data, value):
    from h3core.files.text import parse_json

    read = parse_json(data, "x", "y")
    assert value is None or read == value


def test_a_wrong_top_level_type_is_named():
    from h3core.files.text import parse_json

    with pytest.raises(ConfigError, match=r"^x: a JSON array, not an object; y$"):
        parse_json("[1]", "x", "y", want=dict)
    with pytest.raises(ConfigError, match=r"^x: a JSON string, not an object; y$"):
        parse_json('"a"', "x", "y", want=dict)


def test_a_document_larger_than_its_bound_is_refused_by_its_size_before_it_is_parsed():
    from h3core.files.text import parse_json

    with pytest.raises(ConfigError, match=r"^x: larger than 1 KiB; y$"):
        parse_json(b"[" + b"1," * 1000 + b"1]", "x", "y", limit=1024)


def test_deep_json_is_refused_fast_and_without_a_large_allocation():
    import time
    import tracemalloc

    from h3core.files.text import parse_json

    text = "[" * 1_000_000 + "]" * 1_000_000  # 2 MB
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="nested deeper than 100 levels"):
        parse_json(text, "x", "y")
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < 2 and peak < 32 << 20, (seconds, peak)


def test_the_parsers_own_recursion_limit_is_the_same_line(monkeypatch):
    """The depth check's backstop: were it to let a document through, Python's RecursionError is
    still the one typed line."""
    import h3core.files.text as text

    monkeypatch.setattr(text, "MAX_DEPTH", 10**9)
    with pytest.raises(ConfigError, match="^x: JSON nested too deeply; y$"):
        text.parse_json(DEEP, "x", "y")


@pytest.mark.parametrize("mark", [b"\xef\xbb\xbf", b""])
def test_text_files_drop_a_byte_order_mark(tmp_path, mark):
    from h3core.files.text import read_json, read_text

    (tmp_path / "t.txt").write_bytes(mark + "a fox\n".encode())
    (tmp_path / "j.json").write_bytes(mark + b'{"a": 1}')
    assert read_text(tmp_path / "t.txt", "--thing", 1024, "fix it") == "a fox\n"
    assert read_json(tmp_path / "j.json", "--thing", 1024, "fix it") == {"a": 1}
    (tmp_path / "bad.txt").write_bytes(mark + b"a \xc3\x28")
    with pytest.raises(ConfigError, match=rf"^cannot read --thing {tmp_path}/bad.txt: not UTF-8 text \(byte {len(mark) + 2}\); fix it$"):
        read_text(tmp_path / "bad.txt", "--thing", 1024, "fix it")


# --- prompt files: a byte-order mark, deep or long JSON lines --------------------------------------------


@pytest.mark.parametrize("mark", [b"\xef\xbb\xbf"])
def test_a_byte_order_mark_is_not_part_of_a_prompt(tmp_path, mark):
    text = tmp_path / "p.txt"
    text.write_bytes(mark + b"a red fox\n" + mark + b"a cat\n")  # the second: a file joined with `cat`
    assert [e.prompt for e in read_prompts(text)] == ["a red fox", "a cat"]
    jsonl = tmp_path / "p.txt"  # (no .jsonl suffix: the first line's brace says JSONL, after the mark)
    jsonl.write_bytes(mark + b'{"prompt": "a red fox", "seed": 3}\n' + mark + b'{"prompt": "a cat"}\n')
    entries = read_prompts(jsonl)
    assert [(e.prompt, e.seed) for e in entries] == [("a red fox", 3), ("a cat", None)]


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested deeper than 100 levels"),
    ('{"prompt": "a", "seed": ' + "9" * 5000 + "}", "a number of 5000 characters"),
    ('{"prompt": "a", "seed": -' + "9" * 30 + "}", "seed: "),
    ('{"prompt": "   "}', "prompt: is empty or only whitespace"),
])
def test_a_hostile_jsonl_line_is_one_line_naming_file_and_line(tmp_path, line, reason):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError) as caught:
        read_prompts(path)
    assert f"--prompts {path}, line 2: " in str(caught.value) and reason in str(caught.value) and "\n" not in str(caught.value)


def test_the_command_refuses_a_deep_prompt_line_in_one_line_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    code, out, err = run_main(capsys, "generate", "--prompts", str(prompts), "--output", str(tmp_path / "run"))
    assert code == 2 and "JSON nested deeper than 100 levels" in one_line(err) and out == ""
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


def test_reports_and_caches_h3_reads_back_are_read_bounded_and_a_bad_one_is_redone(tmp_path, monkeypatch):
    """What h3 wrote and reads again (a batch prompt's report.json, a folder's index, the fingerprint
    cache) goes through the same reader: a deep or malformed one is 'not h3's', never a traceback."""
    from h3core.batch.plan import written_fingerprint
    from h3core.files import fingerprint

    for text in (DEEP, '{"request_fingerprint": ' + "9" * 5000 + "}", "\ufeff" + '{"request_fingerprint": "abc"}'):
        (tmp_path / "report.json").write_text(text)
        assert written_fingerprint(tmp_path) == ("abc" if text.startswith("\ufeff") else None)
    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path / "cache"))
    key = (str(tmp_path / "f"), 1, 2, 3, 4, 5)
    fingerprint._cache_file(key).parent.mkdir(parents=True)
    fingerprint._cache_file(key).write_text(DEEP[:60_000])
    assert fingerprint._cached(key) is None
