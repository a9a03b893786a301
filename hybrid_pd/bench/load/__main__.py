"""The bench's child inside its private network namespace: `run_in_netns` starts it as
`python -m hybrid_pd.bench.load` with the options in the environment; it prints the
result as one line of JSON."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from hybrid_pd.bench.load.options import LoadOptions
from hybrid_pd.bench.load.procs import OPTS_ENV
from hybrid_pd.bench.load.scenarios import run_bench


def main() -> int:
    def interrupted(*_: Any) -> None:
        raise KeyboardInterrupt  # so that every `serve` is stopped on the way out

    signal.signal(signal.SIGTERM, interrupted)
    opts = LoadOptions.from_dict(json.loads(os.environ[OPTS_ENV]))
    print(json.dumps(run_bench(opts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
