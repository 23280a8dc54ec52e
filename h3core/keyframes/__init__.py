"""Keyframes (FL2VA): the images a request starts and/or ends on, opened, checked and put on the canvas
(`images.py`). The vision tower that reads them is part of the text encoder (`h3core.text`)."""

from h3core.errors import KeyframeError
from h3core.keyframes.images import ROLES, canvas_for, open_keyframe, prepare_keyframes

__all__ = ["ROLES", "KeyframeError", "canvas_for", "open_keyframe", "prepare_keyframes"]
