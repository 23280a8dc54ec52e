"""`python -m h3core.generate.dryrun REPORT [ARCH]`: the dry run of the run an `h3 generate --json`
report describes, next to the peaks its ranks measured (scripts/gpu_check.sh)."""

import json
import sys
from pathlib import Path

from h3core.generate.dryrun.command import compare_with_report

print(json.dumps(compare_with_report(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None), indent=1))
