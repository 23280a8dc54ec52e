"""torchrun's env:// rendezvous, bounded: a stale torchrun environment is one line, not a hang.

`init_process_group(init_method="env://")` waits as long as the collective timeout (600 s) for
peers that a stale environment (RANK/WORLD_SIZE/LOCAL_RANK left over in a shell) will never start.
`torchrun_store` does the same rendezvous (`torch.distributed.rendezvous`, which also knows
torchrun's agent-hosted store) with its own bound, `H3_RANK_TIMEOUT`, then gives the store the
collective timeout, as `init_process_group` would. The store's C++ retries print stack traces to
fd 2; they are held and shown only with H3_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

from h3core import settings
from h3core.errors import ConfigError
from h3core.settings import RANK_TIMEOUT, TorchrunEnv

_STALE = "if torchrun did not start this command, unset RANK, WORLD_SIZE and LOCAL_RANK"


def torchrun_store(launched: TorchrunEnv, rendezvous_s: float, timeout: timedelta) -> Any:
    """The rendezvous store of a torchrun launch, found within `rendezvous_s` or a ConfigError line."""
    import torch.distributed as dist

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not settings.env_str(name)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise ConfigError(f"{launched.describe()} says torchrun started h3, but {' and '.join(missing)} {verb} not set; {_STALE}")
    try:
        with _native_stderr_held():
            store, _, _ = next(dist.rendezvous("env://", launched.rank, launched.world_size, timeout=timedelta(seconds=rendezvous_s)))
    except (RuntimeError, ValueError, OSError) as err:
        raise ConfigError(
            f"{launched.describe()}: the {launched.world_size} torchrun ranks did not meet within {rendezvous_s:g} s "
            f"({' '.join(str(err).split())[:160]}); {_STALE}, or raise {RANK_TIMEOUT}"
        ) from err
    store.set_timeout(timeout)
    return store


@contextmanager
def _native_stderr_held() -> Iterator[None]:
    """Hold what native code writes to fd 2 during the block; show it afterwards only with H3_DEBUG=1."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if settings.debug():
                held.seek(0)
                os.write(2, held.read())
