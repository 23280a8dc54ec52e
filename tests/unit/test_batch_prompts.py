"""The prompt file of `h3 generate --prompts` (text and JSONL, every malformed case one line naming
the file and line) and the resume check (a result is complete only for the same resolved request)."""

from __future__ import annotations

import json

import pytest

from h3core.batch.plan import is_complete
from h3core.batch.prompts import folder_names, read_prompts, slug
from h3core.errors import ConfigError


def _file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_text_file_one_prompt_per_line_skips_blank_and_comment_lines(tmp_path):
    entries = read_prompts(_file(tmp_path, "p.txt", "# a batch\n a red fox \n\n   \n# skip\nan owl at night\n"))
    assert [(e.line, e.prompt) for e in entries] == [(2, "a red fox"), (6, "an owl at night")]
    assert entries[0].overrides() == {"prompt": "a red fox"}


def test_jsonl_fields_become_request_overrides(tmp_path):
    line = {"prompt": "a cat", "negative_prompt": "blur", "seed": 7, "width": 64, "height": 32, "frames": 5, "steps": 2, "guidance": 3, "name": "cat"}
    (entry,) = read_prompts(_file(tmp_path, "p.jsonl", json.dumps(line) + "\n"))
    assert entry.overrides() == {"prompt": "a cat", "negative_prompt": "blur", "seed": 7, "width": 64, "height": 32, "frames": 5,
                                 "steps": 2, "guidance_scale": 3.0}
    assert folder_names([entry]) == ["000-cat"]


def test_a_file_whose_first_prompt_starts_with_a_brace_is_jsonl(tmp_path):
    with pytest.raises(ConfigError, match=r"p\.txt, line 2: not valid JSON"):
        read_prompts(_file(tmp_path, "p.txt", '{"prompt": "a"}\n{"prompt": "b"\n'))


@pytest.mark.parametrize(("text", "message"), [
    ('{"prompt": "a"}\n\n{"prompt": "b", "sed": 1}\n', r"line 3: unknown field 'sed'"),
    ('{"seed": 1}\n', r"line 1: no \"prompt\""),
    ('["a"]\n', r"line 1: a JSON array, not an object"),
    ('{"prompt": "a", "seed": -1}\n', r"line 1: seed: .*greater than or equal to 0"),
    ('{"prompt": "a", "seed": "1"}\n', r"line 1: seed: .*valid integer"),
    ('{"prompt": "a", "width": true}\n', r"line 1: width: "),
    ('{"prompt": "a", "guidance": NaN}\n', r"line 1: guidance: "),
    ('{"prompt": ""}\n', r"line 1: prompt: "),
    ('{"prompt": "a", "name": "../up"}\n', r"line 1: name: "),
])
def test_a_malformed_jsonl_line_is_one_error_naming_file_and_line(tmp_path, text, message):
    path = _file(tmp_path, "p.jsonl", text)
    with pytest.raises(ConfigError, match=message) as err:
        read_prompts(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_empty_or_binary_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no prompts in the file"):
        read_prompts(_file(tmp_path, "p.txt", "# only a comment\n\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        read_prompts(tmp_path / "absent.txt")
    binary = tmp_path / "p.bin"
    binary.write_bytes(b"\xff\xfe a")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_prompts(binary)


def test_folder_names_are_numbered_slugs():
    assert slug("A red fox, running through SNOW!") == "a-red-fox-running-through-snow"
    assert slug("   ...  ") == "prompt" and len(slug("word " * 40)) <= 40
    entries = read_prompts_from(["x"] * 1001)
    names = folder_names(entries)
    assert names[0] == "0000-x" and names[-1] == "1000-x" and len(set(names)) == 1001


def read_prompts_from(prompts):
    from h3core.batch.prompts import PromptEntry

    return [PromptEntry(line=i + 1, prompt=p) for i, p in enumerate(prompts)]


def test_a_result_is_complete_only_for_the_same_request_and_with_its_latents(tmp_path):
    folder = tmp_path / "000-a"
    folder.mkdir()
    assert not is_complete(folder, "f1", save_latents=False)  # no report
    (folder / "report.json").write_text(json.dumps({"request_fingerprint": "f1"}))
    assert is_complete(folder, "f1", save_latents=False)
    assert not is_complete(folder, "f2", save_latents=False)  # a changed prompt, seed or size
    assert not is_complete(folder, "f1", save_latents=True)  # latents asked for, none written
    (folder / "latents.safetensors").write_bytes(b"x")
    assert is_complete(folder, "f1", save_latents=True)
    (folder / "report.json").write_text("{half")
    assert not is_complete(folder, "f1", save_latents=False)


def test_the_fingerprint_follows_what_decides_the_result():
    from h3core.generate.report import request_fingerprint
    from h3core.generate.request import GenerateRequest, resolve

    base = resolve(GenerateRequest(steps=3))
    assert request_fingerprint(base) == request_fingerprint(resolve(GenerateRequest(steps=3)))
    for change in ({"seed": 1}, {"prompt": "other"}, {"width": 128}, {"steps": 2}, {"guidance_scale": 2.0}):
        assert request_fingerprint(resolve(GenerateRequest(**{"steps": 3, **change}))) != request_fingerprint(base), change
