"""`h3 serve`: the Videos API (OpenAI's shape) in front of the engine `h3 generate --prompts` runs.

- `api`: the request and response models (pydantic) and `ApiError`, errors in OpenAI's shape;
- `request`: `to_generate_request`, the ONE place an API request becomes a `GenerateRequest`;
- `inputs`: keyframe images (uploads, or server-local paths under `--allow-path`), capped and saved;
- `queue`: the jobs in SQLite (WAL, one file under `--state-dir`), what survives a crash;
- `engine`: the World that stays up, one job per replica group per round, results published whole;
- `app`: the FastAPI application (routes, auth, body cap, the page);
- `metrics`: Prometheus text;
- `server`: `serve(job)`, the one call behind the command (uvicorn on a thread, the engine here).

docs/serve.md is the user's side of it.
"""
