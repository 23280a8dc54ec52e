"""H3's tokenizer as h3 ships and builds it, against the reference: transformers' tokenizer built from
the same files (`AutoTokenizer.from_pretrained(h3_tokenizer/)`, as diffusers loads H3's folder),
called as H3 calls it (`add_special_tokens=False`). H3's 7 added tokens are one token each at
151669-151675 (ComfyUI's `MINIMAX_EXTRA_TOKENS`)."""

from __future__ import annotations

import hashlib
import re

import pytest

from h3core.errors import CheckpointError
from h3core.text.tokenizer import SHIPPED_FOLDER, folder_tokenizer, load_tokenizer, shipped_tokenizer

H3_TOKENS = {"<d>": 151669, "</d>": 151670, "<|cutoff|>": 151671, "<|lyrics_start|>": 151672,
             "<|lyrics_end|>": 151673, "<|caption_start|>": 151674, "<|caption_end|>": 151675}

PROMPTS = [
    "a red fox running through snow, wind noise",
    "<d>[English] Then I will take two.</d>",
    "A woman at a café says <d>[French] Je prends deux croissants, s'il vous plaît.</d> then laughs",
    "一只红狐狸在雪地里奔跑，风声呼啸，远处传来铃声。<d>[Chinese] 快跑！</d>",
    "東京の夜、雨とネオン。<|cutoff|> 서울의 아침 🦊🌨️ Ünïcödé ñ ß ø",
    "cafe\u0301 vs caf\u00e9 (NFD and NFC)",
    "<|lyrics_start|>la la la\nsecond line<|lyrics_end|><|caption_start|>A song.<|caption_end|>",
    "<Picture 1>: <|vision_start|><|image_pad|><|image_pad|><|vision_end|> the scene continues",
    "numbers 1234567 and 3.14159, code x = f(y) + 2;  tabs\tand   spaces\n\n\nnewlines  ",
    "don't, I'm, we'll, they've, it's, she'd -- CAPS'LL and Mixed'Re",
    "<d>unclosed marker and </d></d><d> adjacent",
    "",
]

# Measured through ComfyUI's MiniMaxH3Tokenizer on the released vocabulary (a public H3 notes file).
KNOWN = {"<d>[English] Then I will take two.</d>": [151669, 58, 22574, 60, 5005, 358, 686, 1896, 1378, 13, 151670]}

SHA256 = {
    "vocab.json": "ca10d7e9fb3ed18575dd1e277a2579c16d108e32f27439684afa0e10b1440910",
    "merges.txt": "599bab54075088774b1733fde865d5bd747cbcc7a547c5bc12610e874e26f5e3",
}


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SHIPPED_FOLDER))


def _reference_ids(reference, prompt: str) -> list[int]:
    return reference(prompt, add_special_tokens=False)["input_ids"]


def test_token_ids_equal_the_reference_tokenizers(reference):
    ours = shipped_tokenizer()
    for prompt in PROMPTS + list(KNOWN):
        assert ours.encode(prompt) == _reference_ids(reference, prompt), prompt
    assert ours.vocab_size == len(reference) == 151_676
    for prompt, ids in KNOWN.items():
        assert ours.encode(prompt) == ids


def test_h3_tokens_are_one_token_each_at_their_ids(reference):
    ours = shipped_tokenizer()
    for token, token_id in H3_TOKENS.items():
        assert ours.encode(token) == [token_id] == _reference_ids(reference, token)
        assert ours.encode(f"x{token}y")[1] == token_id  # matched whole inside text


def test_a_folders_tokenizer_json_gives_the_same_ids(tmp_path, reference):
    reference.save_pretrained(str(tmp_path))  # tokenizer.json + tokenizer_config.json, as a checkpoint ships them
    assert (tmp_path / "tokenizer.json").is_file()
    theirs = folder_tokenizer([tmp_path / "missing", tmp_path], tmp_path)
    assert theirs.name == str(tmp_path)
    for prompt in PROMPTS:
        assert theirs.encode(prompt) == shipped_tokenizer().encode(prompt), prompt


def test_shipped_files_are_the_recorded_ones():
    for name, digest in SHA256.items():
        assert hashlib.sha256((SHIPPED_FOLDER / name).read_bytes()).hexdigest() == digest, name
    for name in ("LICENSE", "README.md", "tokenizer_config.json"):
        assert (SHIPPED_FOLDER / name).is_file()
    assert "Apache License" in (SHIPPED_FOLDER / "LICENSE").read_text()


def test_a_config_at_odds_with_the_vocabulary_is_refused(tmp_path):
    import json
    import shutil

    for name in ("vocab.json", "merges.txt"):
        shutil.copy(SHIPPED_FOLDER / name, tmp_path / name)
    config = json.loads((SHIPPED_FOLDER / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["151700"] = config["added_tokens_decoder"].pop("151643")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape("puts '<|im_start|>' at id 151644 but the vocabulary gives it 151643")):
        load_tokenizer(tmp_path, "odd")
