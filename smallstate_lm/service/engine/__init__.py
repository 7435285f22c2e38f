"""The engine process: the model(s) on the device, the one queue and admission, the batcher, the LM forwards and
lattice expansion (`engine.Engine`; `python -m smallstate_lm.service.engine RUNDIR`, started by the supervisor)."""
