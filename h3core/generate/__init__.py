"""`h3 generate`: text in, video + audio latents out, on 1..N ranks (diffusers' split of scheduler,
model and pipeline; the sampler is `h3core.model.sampler`, the model `h3core.model.dit`).

In the launching process:
- `request`    what was asked (`GenerateRequest`, `GenerateJob`) and `resolve`: config, sizes, plan,
               checks, checkpoint, before any rank starts
- `memory`     what a run needs per rank, from its plan, checked against the machine
- `run`        the orchestration: `generate` (reserve outputs, run the ranks, report, publish),
               `execute` (one World), the one-rank reference and parity
- `report`     the report schema (`RunReport`) built from every rank's outcome
- `files`      the report, latents and preview written into the output folder

On every rank (`pipeline.rank_generate`):
- `pipeline`   `RankPipeline`: the model loaded and parallelized once, then one request denoised
- `sequences`  the packed sequences of a request, this rank's rows of them, the seeded noise
- `loop`       the denoising loop on one rank: velocity of its rows, guidance, Euler step
- `parity`, `profile`  the latents' bound vs one rank; where a step's time goes (`--profile`)
"""
