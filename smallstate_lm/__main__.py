"""`python -m smallstate_lm ...` and `torchrun --nproc_per_node N -m smallstate_lm train ...`."""

from .cli import main

if __name__ == "__main__":
    main()
