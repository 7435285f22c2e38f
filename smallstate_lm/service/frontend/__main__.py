"""`python -m smallstate_lm.service.frontend RUNDIR INDEX`: front-end INDEX of the service whose run directory is
RUNDIR, serving HTTP on the service's port (the supervisor starts it)."""

import sys

from ..supervisor import read_run, setup_logging


def main() -> int:
    rundir, index = sys.argv[1], int(sys.argv[2])
    settings, _, board = read_run(rundir)
    setup_logging(settings)
    import torch

    torch.set_num_threads(1)  # a front-end never runs the model: its cores are the requests'
    from .server import run_frontend

    return run_frontend(settings, rundir, index, board)


if __name__ == "__main__":
    sys.exit(main())
