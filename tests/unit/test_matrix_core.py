"""`h3 matrix` without running a model: settings precedence (`h3core.settings`), skip logic, summary math, rendering."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from h3core import settings
from h3core.errors import CheckFailed, ConfigError, PartitionError
from h3core.generate.parity import LatentParity
from h3core.generate.report import StepDone
from h3core.generate.request import GenerateRequest
from h3core.matrix import cells as mx_cells
from h3core.matrix.cells import PlannedCell, plan_cells, skip_reason
from h3core.matrix.render import COLUMNS, chart_png, markdown, notes, summary_rows
from h3core.matrix.report import SINGLE_STEP_NOTE, CellStatus, MatrixCell, MatrixReport
from h3core.matrix.request import MatrixRequest
from h3core.matrix.run import _Bar
from h3core.matrix.summary import scaling, steady_step_seconds, summarise
from h3core.errors import LayoutError
from h3core.parallel.layout import RankLayout
from h3core.parallel.modes import Mode
from h3core.reports.schema import Versions
from h3core.reports.units import format_bytes


def counts_setting(flag):
    return MatrixRequest.build(GenerateRequest(device="cpu"), counts=flag, output=Path("unused")).counts


def modes_setting(flag):
    return MatrixRequest.build(GenerateRequest(device="cpu"), modes=flag, output=Path("unused")).modes


def output_setting(flag):
    return MatrixRequest.build(GenerateRequest(device="cpu"), output=flag).output


SEED_VARS = ("H3_GPU_COUNTS", "H3_DISTRIBUTED_MODES", "H3_SAVE_LATENTS", "H3_WORLD_SIZE", "H3_DISTRIBUTED_OUTPUT", "H3_DISTRIBUTED_BENCHMARK")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SEED_VARS:
        monkeypatch.delenv(name, raising=False)


# --- settings: flag > variable > default ------------------------------------------------------------


def test_counts_default_is_the_seeds_matrix():
    assert counts_setting(None) == [1, 2, 4, 6, 8]


def test_counts_variable_beats_default_and_flag_beats_variable(monkeypatch):
    monkeypatch.setenv("H3_GPU_COUNTS", "8,2 4")
    assert counts_setting(None) == [2, 4, 8]  # ascending, spaces allowed
    assert counts_setting("1,1,3") == [1, 3]  # the flag wins; duplicates dropped


@pytest.mark.parametrize("value", ["1,x", "0,2", ","])
def test_bad_counts_variable_names_it(monkeypatch, value):
    monkeypatch.setenv("H3_GPU_COUNTS", value)
    with pytest.raises(ConfigError, match="H3_GPU_COUNTS"):
        counts_setting(None)


def test_bad_counts_flag_names_the_flag():
    with pytest.raises(ConfigError, match="--counts"):
        counts_setting("2,-1")


def test_modes_default_variable_and_flag(monkeypatch):
    assert modes_setting(None) == [Mode.ULYSSES, Mode.TENSOR]
    monkeypatch.setenv("H3_DISTRIBUTED_MODES", "Tensor")
    assert modes_setting(None) == [Mode.TENSOR]
    assert modes_setting("tensor,ulysses,tensor") == [Mode.TENSOR, Mode.ULYSSES]  # flag wins, order kept


def test_unknown_mode_names_its_source(monkeypatch):
    monkeypatch.setenv("H3_DISTRIBUTED_MODES", "ulysses,ring")
    with pytest.raises(ConfigError, match="H3_DISTRIBUTED_MODES .* 'ring'; choose from ulysses, tensor"):
        modes_setting(None)
    with pytest.raises(ConfigError, match="--modes is empty"):
        modes_setting(",")


@pytest.mark.parametrize(("flag", "variable", "expected"), [
    (None, None, True), (None, "0", False), (None, "1", True), (None, "false", False),
    (True, "0", True), (False, "1", False),
])
def test_save_latents_precedence(monkeypatch, flag, variable, expected):
    if variable is not None:
        monkeypatch.setenv("H3_SAVE_LATENTS", variable)
    assert settings.save_latents(flag) is expected


def test_save_latents_rejects_a_non_boolean(monkeypatch):
    monkeypatch.setenv("H3_SAVE_LATENTS", "maybe")
    with pytest.raises(ConfigError, match="H3_SAVE_LATENTS"):
        settings.save_latents(None)


def test_output_and_benchmark_precedence(monkeypatch, tmp_path):
    default = output_setting(None)
    assert default.parent == Path("outputs") and "-matrix-" in default.name and default != output_setting(None)  # never shared
    assert settings.benchmark_path(None) is None
    monkeypatch.setenv("H3_DISTRIBUTED_OUTPUT", str(tmp_path / "env"))
    monkeypatch.setenv("H3_DISTRIBUTED_BENCHMARK", str(tmp_path / "bench.json"))
    assert output_setting(None) == tmp_path / "env"
    assert settings.benchmark_path(None) == tmp_path / "bench.json"
    assert output_setting(tmp_path / "flag") == tmp_path / "flag"
    assert settings.benchmark_path(tmp_path / "b.json") == tmp_path / "b.json"


def test_world_size_count_beats_variable_beats_visible_gpus(monkeypatch):
    assert settings.world_size(None, lambda: 4) == 4  # default: every visible GPU
    monkeypatch.setenv("H3_WORLD_SIZE", "2")
    assert settings.world_size(None, lambda: 4) == 2  # the variable beats the default
    assert settings.world_size(6, lambda: 4) == 6  # the positional count beats the variable
    monkeypatch.delenv("H3_WORLD_SIZE")
    assert settings.world_size(None, lambda: 0) == 1


def test_matrix_counts_ignore_h3_world_size(monkeypatch, tmp_path):
    """H3_WORLD_SIZE is the count of one run; the matrix takes its counts from --counts / H3_GPU_COUNTS."""
    monkeypatch.setenv("H3_WORLD_SIZE", "3")
    request = MatrixRequest.build(GenerateRequest(device="cpu"), output=tmp_path)
    assert request.counts == [1, 2, 4, 6, 8] and request.template.world_size == 1


# --- skip logic --------------------------------------------------------------------------------------


def _request(counts, modes=(Mode.ULYSSES,), device="cpu", tmp=Path("unused")) -> MatrixRequest:
    template = GenerateRequest(device=device, preset="tiny", steps=2)
    return MatrixRequest(counts=counts, modes=list(modes), template=template, save_latents=False, output=tmp)


def test_skip_reason_only_on_cuda():
    assert skip_reason(8, "cpu", 0) is None  # CPU: Gloo ranks, any count
    assert skip_reason(2, "cuda", 2) is None
    assert skip_reason(4, "cuda", 2) == "4 GPUs needed, 2 visible"


def test_cuda_counts_above_the_visible_gpus_are_skipped():
    planned = plan_cells(_request([2, 4, 8], modes=(Mode.ULYSSES, Mode.TENSOR), device="cuda"), visible_gpus=2)
    assert [(p.mode, p.count) for p in planned] == [(m, c) for m in (Mode.ULYSSES, Mode.TENSOR) for c in (1, 2, 4, 8)]
    by_count = {p.count: p for p in planned if p.mode == Mode.TENSOR}
    assert by_count[1].run is not None and by_count[1].requested is False  # the baseline, added
    assert by_count[2].run is not None and by_count[2].run.request.world_size == 2 and by_count[2].run.request.mode == Mode.TENSOR
    assert by_count[4].run is None and by_count[4].skip == "4 GPUs needed, 2 visible"
    assert by_count[8].skip == "8 GPUs needed, 2 visible"


def test_counts_the_partition_rejects_are_skipped_with_its_message():
    planned = plan_cells(_request([1, 9]), visible_gpus=0)  # tiny has 8 heads
    assert planned[0].run is not None and planned[0].requested is True
    assert planned[1].run is None and "9" in planned[1].skip and "head" in planned[1].skip


def test_cfg_cells_follow_each_mode_and_counts_that_cannot_split_are_skipped_with_the_reason():
    template = GenerateRequest(device="cpu", preset="tiny", steps=2, guidance_scale=3.0)
    request = MatrixRequest(counts=[2, 3, 18], modes=[Mode.TENSOR], template=template, save_latents=False, output=Path("unused"), cfg_parallel=True)
    planned = plan_cells(request, visible_gpus=0)
    assert [(p.count, p.cfg_parallel, p.run is not None) for p in planned] == [
        (1, False, True), (2, False, True), (3, False, True), (18, False, False), (2, True, True), (3, True, False), (18, True, False),
    ]
    assert planned[4].run.plan.layout.cfg_parallel and planned[4].run.plan.world_size == 1
    assert "3 is odd" in planned[5].skip and "per group (world 18 = 1 replica x 2 CFG halves x 9" in planned[6].skip
    with pytest.raises(LayoutError, match="--cfg-parallel needs guidance"):
        MatrixRequest.build(GenerateRequest(device="cpu"), output=Path("unused"), cfg_parallel=True)


def test_a_one_rank_cell_that_cannot_resolve_stops_the_matrix(monkeypatch):
    def reject(request):
        raise PartitionError("no")

    monkeypatch.setattr(mx_cells, "resolve", reject)
    with pytest.raises(PartitionError):
        plan_cells(_request([1, 2]), visible_gpus=0)


# --- summary math --------------------------------------------------------------------------------------


def test_scaling():
    assert scaling(2.0, 0.5, 4) == (4.0, 1.0)
    speedup, efficiency = scaling(1.2, 0.8, 2)
    assert speedup == pytest.approx(1.5) and efficiency == pytest.approx(0.75)
    assert scaling(1.0, 2.0, 8) == (0.5, 0.0625)  # slower than one rank: below 1
    assert scaling(None, 1.0, 2) == (None, None)  # no baseline (the 1-rank cell failed)
    assert scaling(1.0, 0.0, 2) == (None, None)


def test_step_time_leaves_out_the_warm_up_step():
    assert steady_step_seconds([5.0, 1.0, 3.0, 2.0]) == 2.0  # median of 1, 3, 2
    assert steady_step_seconds([5.0, 1.0]) == 1.0
    assert steady_step_seconds([5.0]) is None  # one step carries warm-up: no step time, no speedup
    assert steady_step_seconds([]) is None


def test_progress_counts_every_planned_step_once():
    seen = []
    bar = _Bar(total=6, callback=seen.append)
    bar.start("ulysses x1")
    bar.step(StepDone(step=1, steps=3, seconds=0.1))
    bar.finish(3)
    bar.start("ulysses x2")  # fails after one step: its steps still count as done
    bar.step(StepDone(step=1, steps=3, seconds=0.1))
    bar.finish(3)
    assert [m.completed for m in seen] == [0, 1, 3, 3, 4, 6]
    assert all(m.total == 6 for m in seen)
    bar.close()
    assert seen[-1].completed == seen[-1].total == 6


# --- report and rendering (a hand-made report) ---------------------------------------------------------


def _parity(relative, tol, bitwise=False):
    return LatentParity(reference="1 rank", video=None, audio=None, max_abs=relative * 3, relative=relative, bitwise=bitwise, tolerance=tol, passed=relative <= tol)


def _cell(mode, count, status=CellStatus.OK, **fields):
    base = dict(requested=True, sampling_seconds=1.0 / count, step_seconds=0.25 / count, speedup=float(count), efficiency=1.0, peak_memory_bytes=300 * 2**20 // count,
                weight_bytes_per_rank=2**20 // count, comm_bytes=count * 1000, threads_per_rank=1)
    if status is not CellStatus.OK:
        base = {"requested": True}
    return MatrixCell(mode=mode, count=count, status=status, **{**base, **fields})


def _report(cells, identity=None) -> MatrixReport:
    return MatrixReport(
        created="20260101T000000Z", complete=True, request=_request([1, 2, 4], modes=(Mode.ULYSSES, Mode.TENSOR)),
        device="cpu", device_name="CPU test (2 cores)", visible_gpus=0, ranks_note="Gloo ranks", dtype="fp32", preset="tiny",
        weights="synthetic", shape=None, peak_memory_kind="rss", cells=cells, identity=identity, versions=Versions(),
    )


@pytest.fixture
def report():
    return _report([
        _cell(Mode.ULYSSES, 1, speedup=1.0),
        _cell(Mode.ULYSSES, 2, parity=_parity(0.0, 1e-6, bitwise=True)),
        _cell(Mode.ULYSSES, 4, CellStatus.FAILED, reason="rank 1 failed: RuntimeError: injected fault"),
        _cell(Mode.TENSOR, 1, requested=False, speedup=1.0),
        _cell(Mode.TENSOR, 2, parity=_parity(3e-5, 1e-5)),
        _cell(Mode.TENSOR, 4, CellStatus.SKIPPED, reason="4 GPUs needed, 2 visible"),
    ], identity=_parity(0.0, 0.0, bitwise=True))


def test_problems_name_failed_cells_and_failed_parity(report):
    problems = report.problems()
    assert problems == ["ulysses x4 failed: rank 1 failed: RuntimeError: injected fault", "tensor x2 parity 3e-05 > tolerance 1e-05"]
    with pytest.raises(CheckFailed, match="2 problem"):
        raise report.failure()


def test_a_clean_matrix_passes_the_check(report):
    assert _report(report.cells[:2]).failure() is None


def test_unmeasured_parity_is_a_problem(report):
    cell = _cell(Mode.ULYSSES, 2, parity_error="the 1-rank cell failed: boom")
    assert _report([cell]).problems() == ["ulysses x2 parity not measured: the 1-rank cell failed: boom"]


def test_summary_rows(report):
    rows = summary_rows(report)
    assert all(len(r) == len(COLUMNS) for r in rows)
    assert rows[0][:6] == ["ulysses", "1", "ok", "1 s", "0.25 s", "1.00"] and rows[0][-1] == "reference"
    assert rows[1][-3:] == ["0", "0 (1e-06)", "bitwise"]
    assert rows[2][2] == "failed" and rows[2][3] == "-"
    assert rows[3][2] == "baseline"  # the 1-rank cell nobody asked for
    assert rows[4][-1] == "FAIL" and rows[4][COLUMNS.index("eff.")] == "100%"
    assert rows[5][2] == "skipped"


def test_markdown_lists_reasons_and_the_cpu_note(report):
    text = markdown(report)
    assert "| mode | ranks | status |" in text and text.count("\n| ") == 1 + len(report.cells)
    assert "- ulysses x4 failed: rank 1 failed: RuntimeError: injected fault" in text
    assert "- tensor x4 skipped: 4 GPUs needed, 2 visible" in text
    assert "core sharing, not GPU scaling" in text
    assert "1-rank identity path, tensor vs ulysses: bitwise identical" in notes(report)


def test_size_labels():
    assert [format_bytes(n) for n in (None, 512, 722_000, 1_480_000, 24 * 2**30)] == ["-", "512 B", "705 KiB", "1.41 MiB", "24 GiB"]


def test_chart_is_a_png(report):
    data = chart_png(report)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1100, 480)



def test_a_single_step_shows_no_step_time_speedup_or_efficiency_and_says_why():
    # One step is all warm-up: on 2 cores it once showed a 9.15x speedup and 457% efficiency.
    from h3core.generate.report import RunFiles

    planned = PlannedCell(Mode.ULYSSES, 2, False, True, None, None)
    run_report = SimpleNamespace(step_seconds=[0.9], timings={"sampling": 0.9}, ranks_on="2 CPU ranks (Gloo)", ranks=[], comm_total=SimpleNamespace(bytes_sent=0), parity=None, profile=None, files=RunFiles(directory="d", report="d/report.json", latents=None, preview=None))
    run_report.ranks = [SimpleNamespace(peak_memory_sampling_bytes=1, weights=SimpleNamespace(resident=1))]
    run_report.partition = SimpleNamespace(layout=RankLayout(degree=2))
    cell = summarise(planned, run_report, 1, baseline_seconds=steady_step_seconds([5.0]), parity_error=None)
    assert cell.step_seconds is None and cell.speedup is None and cell.efficiency is None
    report = _report([cell]).model_copy(update={"scaling_note": SINGLE_STEP_NOTE})
    row = summary_rows(report)[0]
    assert [row[COLUMNS.index(c)] for c in ("step", "speedup", "eff.")] == ["-", "-", "-"]
    assert any("with 1 denoising step there is no step after the first" in line for line in notes(report))
    assert "run with --steps 2 or more" in markdown(report)


def test_split_rows_show_each_category_and_how_the_compute_alone_scales():
    from h3core.matrix.render import SPLIT_COLUMNS, split_rows

    one = {"attention": 0.6, "nvfp4_linears": 0.3, "rest": 0.1, "step": 1.0}
    two = {"attention": 0.3, "nvfp4_linears": 0.15, "seq_to_head": 0.05, "head_to_seq": 0.03, "repartition_rows": 0.02, "rest": 0.05, "step": 0.6}
    rows = split_rows(_report([_cell(Mode.ULYSSES, 1, split=one), _cell(Mode.ULYSSES, 2, split=two), _cell(Mode.TENSOR, 2)]))
    assert len(rows) == 2 and all(len(r) == len(SPLIT_COLUMNS) for r in rows)  # the unprofiled cell has no row
    assert rows[0][3:5] == ["0.6 (60%)", "0.3 (30%)"] and rows[0][-1] == "1.00"
    assert rows[1][5] == "0.05 (8%)" and rows[1][9] == "0.02 (3%)"  # seq->head; other collectives
    assert rows[1][-1] == "2.00"  # (0.6 + 0.3) / (0.3 + 0.15): the compute halved
    assert "Where a step goes" in markdown(_report([_cell(Mode.ULYSSES, 1, split=one)]))
