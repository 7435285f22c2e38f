"""The service's models: the neural LM and/or n-gram, loaded on the worker thread, the cost model
calibrated on them, what `/v1/models` and `/metrics` say about them, and the lattice rescorer that
serves every batch the server runs."""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings

import torch

from smallstate_lm.device import pick_device
from smallstate_lm.errors import ConfigError
from smallstate_lm.lms import load_lms
from smallstate_lm.rescoring.expand.rescorer import ExpandConfig, LatticeRescorer, build_rescorer
from smallstate_lm.rescoring.lattices.lattice import LatticeWarning
from smallstate_lm.scoring.scorer import NeuralScorer
from smallstate_lm.weights import Weights, oov_reference

from .cost import CostModel, calibrate
from .metrics import Metrics
from .settings import Settings

log = logging.getLogger("smallstate_lm.service")

# The rescorer's tables (words, history keys, n-gram states and KenLM's answers) only grow: after its lattices
# have brought this many arcs and expanded arcs, the server starts new ones, so that what a long-running server
# keeps stays bounded (a few hundred bytes an entry: tens of MiB) and its distinct words stay far below the
# rescorer's limit of 2**21 words.
RESCORER_BUDGET = 200_000


class Models:
    """The loaded models and what is derived from them once. `load()` runs on the worker thread;
    the rest only reads what it set, from any thread."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None):
        if settings.lm is None and settings.ngram is None:
            raise ConfigError("give a neural LM (--lm DIR / SMALLSTATE_LM), an n-gram (--ngram FILE / "
                              "SMALLSTATE_NGRAM), or both")
        self.s = settings
        self.metrics = metrics
        self.neural: NeuralScorer | None = None
        self.ngram = None
        self.loaded = None
        self.device = torch.device("cpu")
        self.weights = Weights()
        self.expand_config = ExpandConfig()
        self.cost = CostModel()
        # the time one step of the worker aims at: a new request waits for at most about one step
        self.step_s = settings.slice_ms / 1000
        self.info: dict = {}  # what /v1/models shows
        self._rescorer: LatticeRescorer | None = None
        self._rescorer_load = 0  # lattice arcs and expanded arcs its tables have seen

    def load(self, device: str | None = None, cost: CostModel | None = None, info: dict | None = None) -> None:
        """Load the models on the settings' device (or `device`) and calibrate the cost model on them. A front-end
        gives the engine's calibrated `cost` and description (`info`) instead: it prices and prepares requests with
        the vocabulary, the n-gram (memory-mapped: its pages shared with the engine's) and the neural LM's shape on
        the CPU, never running it."""
        s = self.s if device is None else dataclasses.replace(self.s, device=device)
        # Repaired lattices (dead states dropped) are normal input for a service, not news.
        warnings.filterwarnings("ignore", category=LatticeWarning)
        if s.threads is not None:
            torch.set_num_threads(s.threads)
        try:
            self.device = pick_device(s.device)
        except RuntimeError as e:
            raise ConfigError(f"device {s.device!r}: {e}") from None
        self.weights = Weights.load(s.weights) if s.weights else Weights()
        self.expand_config = ExpandConfig(max_ngram_order=None if s.exact else s.max_ngram_order, beam=s.beam,
                                          max_per_state=s.max_per_state, max_states=s.max_states,
                                          max_level_bytes=s.max_level_bytes)
        # the neural LM self-checks on this device as it loads (finite log-probs of a fixed sentence): a model
        # that fails raises CheckpointError here, and the service never becomes ready
        self.loaded, self.ngram = load_lms(s.lm, s.ngram, self.device, required=False, precision=s.precision)
        if self.loaded is not None:
            batch_tokens = s.batch_tokens or (8192 if self.device.type == "cuda" else 512)
            self.neural = NeuralScorer(self.loaded.model, self.loaded.vocab, self.device, batch_tokens,
                                       s.share_prefixes)
        if cost is not None:
            self.cost, self.info = cost, info or {}
            return
        with torch.inference_mode():
            self.cost = calibrate(self.neural, self.ngram)
        # After the calibration, which so times tree attention itself: the path chosen per call is never the
        # slower one, and the cost model's predictions stay an upper bound of what the worker takes.
        if self.neural is not None and self.device.type == "cuda" and s.choose_paths:
            self.neural.choose_paths()
        log.info("cost model on %s: %s", self.device, self.cost)
        self._describe()

    @property
    def known(self):
        """What decides whether a word is out of vocabulary (`oov_reference`)."""
        return oov_reference(self.neural.vocab if self.neural is not None else None, self.ngram)

    def rescorer(self, weights: Weights, arcs: int) -> LatticeRescorer:
        """A lattice rescorer for `weights`, about to expand lattices of `arcs` arcs in all: every batch shares one
        cache (KenLM is asked about a (state, word) once, not once per batch), each with its own weights."""
        if self._rescorer is None or self._rescorer_load > RESCORER_BUDGET:
            self._rescorer = build_rescorer(self.weights, self.loaded, self.ngram, self.expand_config, self.device)
            self._rescorer.rows_per_call = lambda step: self.cost.rows_per_call(step + 2, self.step_s)
            self._rescorer_load = 0
        self._rescorer_load += arcs
        return self._rescorer.with_weights(weights)

    def expanded(self, arcs: int) -> None:
        """The rescorer's expansions made `arcs` arcs (their steps fill its tables)."""
        self._rescorer_load += arcs

    def forget_rescorer(self) -> None:
        """After an expansion failed part-way (out of memory, a bug): the next batch starts new tables rather
        than trust ones that an entry may have been half added to."""
        self._rescorer = None

    def _describe(self) -> None:
        from smallstate_lm.models import count_parameters

        s, neural_info = self.s, None
        if self.loaded is not None:
            model = self.loaded.model
            numel = model.state_numel_per_position()
            neural_info = {"name": _name(s.lm), "preset": str(self.loaded.config.name),
                           "parameters": count_parameters(model), "vocab_size": len(self.loaded.vocab),
                           "tokenizer": self.loaded.vocab.spec,
                           "state_numel_per_position": numel,
                           "state_bytes_per_position": numel * next(model.parameters()).element_size(),
                           "config": self.loaded.config.to_dict()}
        self.info = {
            "neural": neural_info,
            "ngram": {"name": _name(s.ngram), "order": int(self.ngram.order)} if self.ngram else None,
            "device": str(self.device),
            "precision": s.precision if self.loaded is not None else None,
            "weights": dataclasses.asdict(self.weights),
            "lattice": {**dataclasses.asdict(self.expand_config), "default_nbest": s.lattice_nbest},
            "batching": {"enabled": s.batching, "batch_tokens": self.neural.batch_tokens if self.neural else None,
                         "max_batch_tokens": s.max_batch_tokens, "max_wait_ms": s.max_wait_ms,
                         "wait_for_arrivals": s.wait_for_arrivals,
                         "max_queue": s.max_queue, "slice_ms": s.slice_ms,
                         # on CUDA: seconds per trie node (tree attention) and per padded token, measured at start
                         "path_costs": dataclasses.asdict(self.neural.path_costs)
                         if self.neural is not None and self.neural.path_costs is not None else None},
            "cost_model": dataclasses.asdict(self.cost),
        }
        if self.metrics is not None:
            self.metrics.describe_model({
                "lm": neural_info["name"] if neural_info else "",
                "preset": neural_info["preset"] if neural_info else "",
                "vocab_size": str(neural_info["vocab_size"]) if neural_info else "",
                "state_numel_per_position": str(neural_info["state_numel_per_position"]) if neural_info else "",
                "ngram": _name(s.ngram) if self.ngram else "", "device": str(self.device),
                "torch_threads": str(torch.get_num_threads())})


def _name(path: str | None) -> str:
    """What /v1/models and /metrics show of a model file: its run directory's or file's name. The server's
    filesystem layout is none of a client's business."""
    return os.path.basename(os.path.normpath(path)) if path else ""
