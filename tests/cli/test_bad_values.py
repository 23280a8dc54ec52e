"""Every bad value is one line and exit 2, found before any rank starts or anything is allocated or
written; what the machine cannot hold is refused the same way (run in process through `main`)."""

from __future__ import annotations

import time

import pytest


@pytest.fixture(autouse=True)
def in_tmp(monkeypatch, tmp_path):
    """Each test runs in its own empty folder: a refused run must write nothing there."""
    monkeypatch.chdir(tmp_path)


def _one_line(code: int, err: str, needle: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--steps", "0"], "--steps 0: must be at least 2"),
        (["--steps", "-1"], "--steps -1: must be at least 2"),
        (["--guidance", "-1"], "--guidance -1.0: must be at least 0"),
        (["--guidance", "nan"], "--guidance nan: must be a finite number"),
        (["--guidance", "inf"], "--guidance inf: must be a finite number"),
        (["--width", "0", "--height", "0"], "--width 0: must be at least 1"),  # not the preset's default
        (["--frames", "0"], "--frames 0: must be at least 1"),
        (["--seed", "-1"], "--seed -1: must be at least 0"),  # not wrapped to 2^64 - 1
        (["--seed", str(2**64)], "--seed 18446744073709551616: must be at most 18446744073709551615"),
        (["--gpus", "0"], "world size must be at least 1"),
    ],
)
def test_generate_refuses_bad_values_in_one_line(h3, tmp_path, args, needle):
    code, out, err = h3("generate", *args, "--output", str(tmp_path / "run"))
    _one_line(code, err, needle)
    assert out == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command, needle",
    [
        (["matrix", "--steps", "0"], "--steps 0: must be at least 2"),
        (["matrix", "--guidance", "nan"], "--guidance nan: must be a finite number"),
        (["bench-transport", "2", "--head-dim", "0", "--tokens", "64", "--device", "cpu"], "--head-dim 0: must be at least 1"),
        (["bench-transport", "2", "--iters", "0", "--tokens", "64", "--device", "cpu"], "--iters must be at least 1"),
    ],
)
def test_other_commands_refuse_bad_values_in_one_line(h3, command, needle):
    code, _, err = h3(*command)
    _one_line(code, err, needle)


# --- limits before work --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--width", "100000", "--height", "100000"], "use a smaller --width/--height/--frames"),
        (["--steps", "1000000000"], "use fewer --steps"),
    ],
)
def test_a_run_this_machine_cannot_hold_is_refused_before_anything_is_allocated(h3, tmp_path, monkeypatch, args, needle):
    import h3core.runtime.limits as limits

    monkeypatch.setattr(limits, "host_available", lambda: (16 << 30, "MemAvailable"))  # the same verdict on any machine
    start = time.monotonic()
    code, _, err = h3("generate", *args, "--output", str(tmp_path / "run"))
    line = _one_line(code, err, needle)
    assert "this run needs at least" in line and "16 GiB available (MemAvailable)" in line and "H3_MEMORY_CHECK=0" in line
    assert time.monotonic() - start < 10  # it used to allocate for 15 s before dying
    assert not (tmp_path / "run").exists()


def test_hundreds_of_cpu_ranks_are_refused_and_the_override_is_named(h3):
    code, _, err = h3("bench-transport", "500", "--heads", "500", "--tokens", "500", "--device", "cpu")
    _one_line(code, err, "500 CPU ranks asked for, but h3 starts at most 64 Gloo ranks on one machine")
    assert "H3_MAX_CPU_RANKS=500" in err


def test_the_memory_check_can_be_skipped_when_the_estimate_is_wrong(h3, monkeypatch):
    import h3core.runtime.limits as limits
    from h3core.errors import ResourceLimit

    monkeypatch.setattr(limits, "host_available", lambda: (1 << 20, "MemAvailable"))
    need = limits.MemoryNeed(ranks=1, device="cpu", on_device={"activations": 2 << 20})
    with pytest.raises(ResourceLimit):
        limits.check_memory(need, limits.capacity("cpu", 1), "--width")
    monkeypatch.setenv("H3_MEMORY_CHECK", "0")
    limits.check_memory(need, limits.capacity("cpu", 1), "--width")


def test_the_split_check_counts_the_real_prompt(tmp_path, monkeypatch):
    """The plan is built from the prompt's real token count (the encoder's tokenizer), and guidance's
    negative prompt is a sequence of its own, with its own length."""
    from h3core.generate.request import GenerateRequest, resolve
    from h3core.parallel.modes import Mode
    from h3core.text import check_text_encoder

    monkeypatch.setenv("H3_CACHE_DIR", str(tmp_path))
    tokens = check_text_encoder(None, hidden_size=64).encode
    request = dict(preset="tiny", mode=Mode.TENSOR, world_size=4, width=32, height=32, frames=1, steps=2, device="cpu")
    media = 2 + 16  # 32x32, 1 frame snapped up to 5: 2 latent frames of 1 patch; 8 audio latents per channel
    run = resolve(GenerateRequest(prompt="abcdef", negative_prompt="", guidance_scale=3.0, **request))
    assert [s.num_tokens for s in run.plan.sequences] == [len(tokens("abcdef")) + media, media]