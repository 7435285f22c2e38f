"""`python -m smallstate_lm.cli ...`, as the tests and scripts run the command line."""

from . import main

main()
