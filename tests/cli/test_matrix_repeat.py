"""`h3 matrix --repeat` (issue 34.6): every cell runs R times in rounds interleaved across the cells
(forward, then backward), each run's step time is kept, and the JSON and the Markdown give the
median with its spread. (1-rank cells of both modes: they run in this process, no ranks to spawn;
the speedup spread and its flag are h3core.matrix.summary.rescale's, tests/unit/test_alternate.py.)"""

from h3core.generate.request import GenerateRequest
from h3core.matrix.report import MatrixReport
from h3core.matrix.request import MatrixRequest
from h3core.matrix.run import run_matrix
from h3core.parallel.modes import Mode


def test_cells_run_in_interleaved_rounds_and_report_their_spread(tmp_path):
    template = GenerateRequest(preset="tiny", steps=3, device="cpu", profile=False)
    request = MatrixRequest.build(template, counts="1", modes="ulysses,tensor", save_latents=False, output=tmp_path / "m", repeat=2)
    labels = []
    report = run_matrix(request, lambda progress: labels.append(progress.label))
    started = [label for i, label in enumerate(labels) if label != "done" and (i == 0 or labels[i - 1] != label)]
    assert started == ["ulysses x1", "tensor x1", "tensor x1 (run 2 of 2)", "ulysses x1 (run 2 of 2)"]
    for mode in Mode:
        cell = report.cell(mode, 1)
        assert len(cell.step_seconds_runs) == 2 and cell.step_seconds == sum(cell.step_seconds_runs) / 2
        assert cell.step_spread.min <= cell.step_seconds <= cell.step_spread.max
        assert cell.speedup == 1.0 and not cell.noise
    assert report.identity.bitwise  # the first runs' latents, as before
    saved = MatrixReport.model_validate_json((tmp_path / "m" / "matrix.json").read_text())
    assert saved.cell(Mode.TENSOR, 1).step_seconds_runs == report.cell(Mode.TENSOR, 1).step_seconds_runs
    markdown = (tmp_path / "m" / "matrix.md").read_text()
    assert "each cell ran 2 time(s)" in markdown and f"({report.cell(Mode.TENSOR, 1).step_spread.min:.3g}-" in markdown
