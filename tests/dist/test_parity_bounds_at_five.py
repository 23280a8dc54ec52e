"""The run that a guessed bound failed: `h3 generate ulysses 5 --preset tiny --steps 2 --guidance 3
--negative-prompt "blurry, low quality, distorted" --parity` (here on 5 ranks of the shared World,
each at 1 CPU thread, against one rank at 1 thread, as the command compares them). CPU GEMMs round
rank 0's 1..3-row segments another way, so it is not bitwise; it is within the derived bound."""

import torch

from h3core.generate.parity import latent_parity, run_tolerance, tolerance
from h3core.generate.request import GenerateRequest, resolve
from h3core.parallel.modes import Mode
from h3core.verify.end_to_end import generate_as_one_rank, generate_on_first_ranks
from h3core.verify.session import jobs_on_own_ranks

ISSUE_RUN = dict(preset="tiny", steps=2, guidance_scale=3.0, negative_prompt="blurry, low quality, distorted", mode=Mode.ULYSSES)


def test_ulysses_at_five_ranks_with_guidance_is_within_the_derived_bound(world8):
    five = world8.run(generate_on_first_ranks, 5, resolve(GenerateRequest(**ISSUE_RUN, world_size=5)))[0]
    (one,) = world8.run(jobs_on_own_ranks, [(generate_as_one_rank, (resolve(GenerateRequest(**ISSUE_RUN)), False))])[:1]
    bound = run_tolerance(Mode.ULYSSES, torch.float32, five.nvfp4_paths)
    parity = latent_parity(five.latents, one.latents, bound, "1 rank")
    print(f"ulysses x5, tiny, guidance 3: relative {parity.relative:.3g} (bound {bound:.3g})")
    assert bound == tolerance(Mode.ULYSSES, torch.float32)
    assert parity.passed  # not bitwise on this CPU: 9.5e-7, above the old guessed 1e-6 at other thread counts
