"""`h3 generate --prompts FILE`: many prompts, one load.

- `prompts`  the prompt file (text or JSONL), read and checked whole before anything runs
- `plan`     `BatchJob`; which prompts run: each resolved on its own, the complete ones skipped
- `run`      `run_batch`: one World, the text encoder once, the denoiser once, one `World.run` per
             prompt, each prompt's folder published whole as it finishes, batch.json after each
- `report`   `BatchReport` (batch.json) and the progress the caller's bars show

The rank side (the pipeline held between `World.run` calls) is `h3core.generate.resident`.
"""
