"""A lattice-rescoring job as its workers receive it (Ray actors, `rescore --jobs N` processes): the files
and settings by absolute path, picklable, and the one way a worker loads its rescorer from it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import ConfigError
from ...lms import load_lms
from ...weights import Weights
from ..expand.rescorer import ExpandConfig, LatticeRescorer, build_rescorer
from .context_run import ContextPlan
from .lattice_files import CtmOptions


@dataclass(frozen=True)
class RescoreJob:
    """What a worker needs to rescore lattices, by absolute path (a worker may run in another directory,
    or on another node of a shared filesystem): the decoder's words.txt (None for HTK SLF lattices), a
    neural LM run directory or checkpoint and/or a KenLM file, weights and expansion settings, the number
    of distinct word sequences to keep per lattice, whether to keep the rescored lattices, the CTM's options
    (None: no CTM), whether rescored Kaldi archives are written as text, and the neural LM's precision."""

    words: str | None
    lm: str | None
    ngram: str | None
    weights: Weights
    config: ExpandConfig
    nbest: int = 10
    write_lattices: bool = True
    ctm: CtmOptions | None = None
    archive_text: bool = False
    precision: str = "fp32"
    context: ContextPlan | None = None  # in spoken order, after each document's previous transcripts

    def __post_init__(self):
        if self.lm is None and self.ngram is None:
            raise ConfigError("give a neural LM (--lm DIR), an n-gram (--ngram FILE), or both")
        for name in ("words", "lm", "ngram"):
            p = getattr(self, name)
            if p is not None and not os.path.isabs(p):
                raise ConfigError(f"RescoreJob.{name} must be an absolute path (workers may run elsewhere), got {p!r}")


def load_rescorer(job: RescoreJob, device: str = "cpu") -> LatticeRescorer:
    """Load the job's LMs on `device` (cpu, cuda, cuda:N) into a LatticeRescorer; torch is imported only
    for a neural LM (an n-gram-only worker starts in a tenth of the time)."""
    loaded, ngram = load_lms(job.lm, job.ngram, device, precision=job.precision)
    return build_rescorer(job.weights, loaded, ngram, job.config)
