"""`python -m smallstate_lm.service.engine RUNDIR`: the engine of the service whose run directory is RUNDIR
(the supervisor starts it; its exit status says how it ended: 0, or 3 when its model was refused)."""

import asyncio
import sys

from ..memory import tune_allocator
from ..supervisor import read_run, setup_logging


def main() -> int:
    settings, _, board = read_run(sys.argv[1])
    setup_logging(settings)
    tune_allocator()
    from .engine import Engine

    try:  # the loop uvicorn runs the front-ends on, where installed
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(Engine(settings, sys.argv[1], board).run())


if __name__ == "__main__":
    sys.exit(main())
