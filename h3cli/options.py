"""Option types shared by several commands (one definition, same help everywhere)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Json = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Preset = Annotated[str, typer.Option("--preset", help="Model preset: h3, h3-2blocks, narrow or tiny (a checkpoint's own config wins).")]
Width = Annotated[Optional[int], typer.Option("--width", help="Video width in pixels (default: the preset's).")]
Height = Annotated[Optional[int], typer.Option("--height", help="Video height in pixels (default: the preset's).")]
Frames = Annotated[Optional[int], typer.Option("--frames", help="Video frames, 4k+1 (default: the preset's).")]
