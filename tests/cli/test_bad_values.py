"""Every bad value is one line and exit 2, found before any rank starts or anything is allocated or
written; what the machine cannot hold is refused the same way (run in process through `main`)."""

from __future__ import annotations

import json
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


# `h3 plan` and `h3 bench-transport` refuse, in one line and before any rank starts, what `h3 generate` refuses.
PLANNED_VALUES = [
    (["0"], "world size must be at least 1, got 0"),
    (["8", "--width", "0"], "--width 0: must be at least 1"),  # not the preset's default
    (["8", "--height", "0"], "--height 0: must be at least 1"),
    (["8", "--frames", "0"], "--frames 0: must be at least 1"),
    (["8", "--width", "-32"], "--width -32: must be at least 1"),
    (["8", "--width", "100"], "100x480 is not a multiple of 32 pixels on both axes"),
    (["8", "--height", "96"], "aspect ratio of 9; H3 takes 1:4 to 4:1"),
]


@pytest.mark.parametrize("args, needle", PLANNED_VALUES)
def test_plan_refuses_what_generate_refuses(h3, args, needle):
    code, out, err = h3("plan", *args)
    _one_line(code, err, needle)
    assert out == ""
    code, _, err = h3("generate", "--preset", "h3-2blocks", "--gpus", *args, "--device", "cpu", "--output", "run")
    assert code == 2 and needle in err  # the same line from h3 generate


@pytest.mark.parametrize("args, needle", [
    *PLANNED_VALUES[:1], *[(["2", *a[1:]], n) for a, n in PLANNED_VALUES[1:]],
    (["2", "--head-dim", "7"], "--head-dim 7: head_dim 7 must be a multiple of 16"),
    (["2", "--head-dim", "24"], "--head-dim 24: head_dim 24 must be a multiple of 16"),
    (["2", "--head-dim", "-3"], "--head-dim -3: must be at least 1"),
    (["2", "--heads", "0"], "cannot split 0 attention heads"),
])
def test_bench_transport_refuses_what_generate_refuses_before_any_rank_starts(h3, args, needle):
    start = time.monotonic()
    code, out, err = h3("bench-transport", *args, "--iters", "1", "--warmup", "0", "--device", "cpu", "--skip-attention")
    _one_line(code, err, needle)
    assert out == "" and time.monotonic() - start < 5


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

# --- Typer's own errors: h3's one line, exit 2, never its boxed panel ------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["verify", "parity", "--steps", "0"], "invalid value for '--steps': Input should be greater than or equal to 1; see 'h3 verify -h'"),
    (["generate", "--steps", "abc"], "invalid value for '--steps': Input should be a valid integer"),
    (["generate", "--bogus"], "no such option: --bogus"),
    (["generate", "tensor", "two"], "invalid value for '[COUNT]'"),
    (["generate", "--mode", "sideways"], "invalid value for '--mode': 'sideways' is not one of 'ulysses', 'tensor'"),
    (["nosuch"], "no such command 'nosuch'; see 'h3 -h'"),
    (["decode"], "missing argument 'LATENTS'; see 'h3 decode -h'"),
    (["pod", "create", "--count", "0", "--yes"], "invalid value for '--count'"),
    (["plan", "--width"], "option '--width' requires an argument"),
    (["generate", "--seed", "1" * 5000], "invalid value for '--seed'"),
])
def test_typers_own_errors_are_one_line_and_exit_2(h3, args, needle):
    code, out, err = h3(*args)
    line = _one_line(code, err, needle)
    assert line.startswith("error: ") and "╭" not in err and "Usage:" not in err and out == ""


def test_help_and_the_bare_command_still_print_help(h3):
    code, out, _ = h3("generate", "-h")
    assert code == 0 and "--prompt" in out
    code, out, _ = h3()
    assert code == 2 and "generate" in out  # `h3` alone: its help, as Typer prints it


# --- one rule for every spelling of a value --------------------------------------------------------------


@pytest.mark.parametrize("given, canonical", [("fp32", "fp32"), ("float32", "fp32"), ("bf16", "bf16"), ("bfloat16", "bf16"),
                                              ("fp16", "fp16"), ("float16", "fp16"), ("half", "fp16"), (" BF16 ", "bf16")])
def test_dtype_takes_torchs_names_too(given, canonical):
    from h3core.generate.request import GenerateRequest

    assert GenerateRequest(dtype=given).dtype == canonical


@pytest.mark.parametrize("given", ["float64", "int8", "fp8", "", "[red]x[/red]"])
def test_an_unknown_dtype_is_one_line_naming_the_flag(h3, tmp_path, given):
    code, _, err = h3("generate", "--dtype", given, "--output", str(tmp_path / "run"))
    _one_line(code, err, f"--dtype {given!r}: ")
    assert "fp32 (float32), bf16 (bfloat16) or fp16 (float16)" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["--prompt", ""], ["--prompt", "  \t "], ["--prompt", "\n"]])
def test_an_empty_prompt_is_refused_like_one_in_a_prompt_file(h3, tmp_path, args):
    code, out, err = h3("generate", *args, "--output", str(tmp_path / "run"))
    _one_line(code, err, "is empty or only whitespace; give a prompt with some text in it")
    assert out == "" and not (tmp_path / "run").exists()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": ' + json.dumps(args[1]) + "}\n")
    code, _, err = h3("generate", "--prompts", str(prompts), "--output", str(tmp_path / "run"))
    _one_line(code, err, "prompt: is empty or only whitespace")
