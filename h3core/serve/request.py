"""`to_generate_request`: the ONE place an API request becomes the `GenerateRequest` a job runs.

Every field of `VideoCreate` is mapped here and nowhere else (the page, JSON and multipart
requests, and a job run again after a restart all pass through it):

- `prompt`, `negative_prompt`, `seed`, `steps`, `frames`, `guidance` -> the request's own fields;
- `seconds` -> frames at 24 fps (the config snaps them up to 17n+5); `seconds` and `frames` together
  are refused;
- `size` "WxH" -> width and height;
- `model` must be the served model's name, or absent;
- keyframes (`input_reference`, `keyframes`: already checked and saved by `h3core.serve.inputs`) ->
  `GenerateRequest.keyframes` ({role: path}); adapters (`loras`, paths under `--allow-path`) ->
  `GenerateRequest.loras` (`LoraSpec`s), checked with the request like `--lora`.

What a request leaves out is the server's flags (`template`). A `ConfigError` of the request
(a size the model cannot take, a count that does not split) is a 400 with its one line.
"""

from __future__ import annotations

from h3core.errors import ConfigError
from h3core.generate.request import GenerateRequest
from h3core.lora.spec import LoraSpec
from h3core.media import FPS
from h3core.serve.api import ApiError, VideoCreate
from h3core.serve.inputs import JobInputs


def to_generate_request(create: VideoCreate, template: GenerateRequest, inputs: JobInputs, served_model: str) -> GenerateRequest:
    """The request `create` asks for, on the server's `template` (module docstring)."""
    if create.model is not None and create.model != served_model:
        raise ApiError(400, f"model {create.model!r} is not served here; this server runs {served_model!r} (or leave model out)", "model_not_found", "model")
    update: dict[str, object] = {"prompt": create.prompt}
    if create.negative_prompt is not None:
        update["negative_prompt"] = create.negative_prompt
    if create.guidance is not None:
        update["guidance_scale"] = create.guidance
    for name in ("seed", "steps"):
        if getattr(create, name) is not None:
            update[name] = getattr(create, name)
    update.update(_frames(create))
    if create.size is not None:
        width, height = (int(n) for n in create.size.split("x"))
        update.update(width=width, height=height)
    update.update(_conditioning(inputs))
    try:
        return GenerateRequest(**{**template.model_dump(), **update})
    except ConfigError as err:
        raise ApiError(400, str(err), "invalid_request") from None


def _frames(create: VideoCreate) -> dict[str, int]:
    if create.seconds is not None and create.frames is not None:
        raise ApiError(400, "give seconds or frames, not both", "invalid_request", "seconds")
    if create.frames is not None:
        return {"frames": create.frames}
    if create.seconds is None:
        return {}
    try:
        seconds = float(create.seconds)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= 3600:
        raise ApiError(400, f"seconds {create.seconds!r} is not a positive number of seconds (at most 3600), e.g. \"4\"", "invalid_request", "seconds")
    return {"frames": max(1, round(seconds * FPS))}


def _conditioning(inputs: JobInputs) -> dict[str, object]:
    """Keyframes ({role: path}) and adapters ((path, scale) each), as `GenerateRequest` takes them."""
    update: dict[str, object] = {}
    if inputs.keyframes:
        update["keyframes"] = dict(inputs.keyframes)
    if inputs.loras:
        update["loras"] = tuple(LoraSpec(path=path, scale=scale) for path, scale in inputs.loras)
    return update
