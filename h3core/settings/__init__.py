"""Settings: what a user gives h3 (flags and environment variables) turned into checked values, in
three modules by concern:

- `environment`  every `H3_*` variable and its reader, and the one way every setting is chosen:
                 **a flag beats its variable; a variable beats the default** (`choose`);
- `torchrun`     "launched by torchrun": the one definition (`torchrun_env`), the machine's share of
                 the ranks, rank zero, and the rank count of a run (`world_size`);
- `requests`     `UserRequest`, the pydantic base of every command's request model (an invalid value
                 is one `ConfigError` line naming its flag), and `SizeFlags`.

Torch-free and quick to import: the CLI checks flags before anything heavy starts. The names are
re-exported here (`from h3core import settings; settings.memory_check()`).
"""

from h3core.settings.environment import (  # noqa: F401
    WORLD_SIZE,
    BENCHMARK,
    OUTPUT,
    MODEL_PATH,
    TEXT_ENCODER_PATH,
    SAVE_LATENTS,
    GPU_COUNTS,
    DISTRIBUTED_MODES,
    VIDEO_VAE_PATH,
    AUDIO_VAE_PATH,
    CACHE_DIR,
    EMULATE_FP4,
    CPU_ALLOCATOR,
    RANK_TIMEOUT,
    COLLECTIVE_TIMEOUT,
    MEMORY_CHECK,
    MAX_CPU_RANKS,
    INJECT_FAULT,
    DEBUG,
    API_KEY,
    DEFAULT_SEED,
    DEFAULT_RANK_TIMEOUT_S,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_MAX_CPU_RANKS,
    CPU_ALLOCATOR_CHOICES,
    env_str,
    env_int,
    env_bool,
    parse_bool,
    env_seconds,
    parse_int_list,
    parse_str_list,
    choose,
    output_folder,
    benchmark_path,
    save_latents,
    api_key,
    model_path,
    text_encoder_path,
    video_vae_path,
    audio_vae_path,
    rank_counts,
    mode_names,
    rank_timeout_s,
    collective_timeout_s,
    debug,
    memory_check,
    max_cpu_ranks,
    cache_dir,
    emulate_fp4,
    result_settings,
    cpu_allocator,
    injected_faults,
)
from h3core.settings.torchrun import (  # noqa: F401
    TORCHRUN_VARS,
    LOCAL_WORLD_SIZE,
    TorchrunEnv,
    torchrun_env,
    ranks_on_this_machine,
    under_torchrun,
    is_rank_zero,
    world_size,
)
from h3core.settings.requests import (  # noqa: F401
    UserRequest,
    SizeFlags,
    describe,
)
