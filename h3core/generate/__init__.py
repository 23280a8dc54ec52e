"""`h3 generate`: text in, video + audio latents out, on 1..N ranks (diffusers' split of scheduler,
model and pipeline; the sampler is `h3core.model.sampler`, the model `h3core.model.dit`).

In the launching process:
- `request`    what was asked (`GenerateRequest`, `GenerateJob`) and `resolve`: config, sizes, plan,
               checks, checkpoint, before any rank starts
- `memory`     what a run needs per rank, from its plan, checked against the machine (the
               formula: the host's memory, and the GPUs' where no dry run decides)
- `dryrun`     the rank's own code on fake tensors: `fakes` (its instruments), `predict` (each
               rank's peak), `command` (the GPUs' memory check, `h3 plan --memory`)
- `fp4gate`    the fp4 GEMM self-test of every GPU before the ranks
- `run`        the orchestration: `generate` (reserve outputs, run the ranks, report, publish),
               `execute` (one World), the one-rank reference and parity
- `report`     the report schema (`RunReport`) built from every rank's outcome
- `files`      the report, latents and preview written into the output folder

On every rank (`pipeline.rank_generate`):
- `pipeline`   `RankPipeline`: the model loaded and parallelized once, then one request denoised
- `instruments` `RankInstruments`: what a rank's pipeline measures and asks with (real by default)
- `resident`   many requests on one loaded pipeline (`h3 generate --prompts`)
- `sequences`  the packed sequences of a request, this rank's rows of them, the seeded noise
- `loop`       the denoising loop on one rank: velocity of its rows, guidance, Euler step
- `parity`, `profile`  the latents' bound vs one rank; where a step's time goes (`--profile`)
"""
