"""The matrix's own files, staged in its output folder: matrix.json and matrix.md after every cell,
matrix.png and the `--benchmark` copy when the matrix is complete (each cell writes its own folder)."""

from __future__ import annotations

from h3core.matrix.render import chart_png, markdown
from h3core.matrix.report import CHART_NAME, MARKDOWN_NAME, REPORT_NAME, MatrixFiles, MatrixReport
from h3core.reports.outputs import FileInFolder, OutputFile, OutputFolder
from h3core.reports.schema import report_json


def write_matrix_files(report: MatrixReport, folder: OutputFolder, benchmark: OutputFile | FileInFolder | None, final: bool) -> None:
    """Stage matrix.json and matrix.md; with `final`, also matrix.png and the benchmark copy."""
    out = folder.path
    files = MatrixFiles(directory=str(out), report=str(out / REPORT_NAME), markdown=str(out / MARKDOWN_NAME))
    if final:
        files.chart = str(folder.write(CHART_NAME, chart_png(report)))
        files.benchmark = str(benchmark.path) if benchmark else None
    report.files = files
    folder.write(MARKDOWN_NAME, markdown(report).encode())
    data = report_json(report)
    if final and benchmark is not None:
        benchmark.write(data)
    folder.write(REPORT_NAME, data)
