"""Service settings: one dataclass, read from `SMALLSTATE_*` environment variables and
overridden by the options of `smallstate-lm serve`.

Every limit has a default that a decoder talking to one replica will not hit; each is
checked per request and answered with a 4xx naming the field and the limit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, fields
from typing import Mapping, Sequence

from smallstate_lm.errors import ConfigError

ENV_PREFIX = "SMALLSTATE_"


@dataclass
class Settings:
    # ---- models -------------------------------------------------------------------------
    lm: str | None = None  # neural LM run directory or checkpoint file
    ngram: str | None = None  # KenLM ARPA or binary
    weights: str | None = None  # weights.json (from `smallstate-lm tune`): the default Weights
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    # the neural LM's weights and state: fp32, bf16 or fp16 (log-probs and the softmax stay float32)
    precision: str = "fp32"
    threads: int | None = None  # torch intra-op threads; None: torch's default (all cores)
    # Padded tokens per forward pass within a merged batch; None: 8192 on CUDA, 512 on CPU, where padding
    # costs as much as real tokens and smaller, evenly filled passes are faster.
    batch_tokens: int | None = None
    share_prefixes: bool = True  # score each unique prefix once (trie)
    # on CUDA: time tree attention and padded rows at start and score each batch the faster way (False: always
    # tree attention, whose numbers do not depend on the timing or on a batch's company)
    choose_paths: bool = True
    # ---- lattices (the CLI's defaults) ----------------------------------------------------
    max_ngram_order: int = 4  # histories sharing their last n-1 words merge
    exact: bool = False  # keep full histories instead
    beam: float = 12.0
    max_per_state: int = 64
    max_states: int = 200_000  # expanded states per lattice before pruning harder
    lattice_nbest: int = 1  # distinct word sequences returned per lattice unless `nbest` is given: the best only
    # (a k-best search costs more than the expansion's bookkeeping; a client that wants alternatives asks)
    # ---- HTTP -----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set: `Authorization: Bearer <key>` on /rescore, /score, /v1/models, /metrics
    log_level: str = "info"
    # ---- dynamic batching -----------------------------------------------------------------
    batching: bool = True  # off: every request is scored alone
    max_batch_tokens: int = 32768  # token budget of one merged batch (a larger request runs alone)
    max_wait_ms: float = 5.0  # how long the first request of a batch may wait for company
    # True: wait only while other requests are on their way in (received, not yet queued), so a lone request
    # is not delayed; False: always wait max_wait_ms (larger batches under steady open-loop traffic).
    wait_for_arrivals: bool = True
    max_queue: int = 256  # requests waiting for the worker; beyond it: 503 + Retry-After
    # ---- limits ---------------------------------------------------------------------------
    max_body_bytes: int = 10 * 2**20  # 413 beyond it
    max_utterances: int = 256  # utterances per /rescore, sentences per /score
    max_hypotheses: int = 1000  # hypotheses per utterance
    max_words: int = 200  # words per hypothesis, context or sentence
    max_lattice_arcs: int = 100_000  # arcs per lattice (states are limited to arcs + 1)
    max_nbest: int = 100  # largest `nbest` a request may ask for (lattice n-best search grows with it)
    # Cost estimates, checked before any work (413 beyond them): the neural LM tokens a request's hypothesis
    # lists compute (unique prefixes: trie nodes), and the LM steps its lattices may take (per word arc, the
    # histories its source state may hold: the paths into it, at most max_per_state).
    max_trie_nodes: int = 200_000
    max_lattice_cost: int = 2_000_000
    # Predicted by the cost model calibrated at warm-up (docs/service.md, "The cost model"): a request's seconds
    # on this device and its peak bytes of working memory and LM state; 413 beyond them.
    max_request_seconds: float = 60.0
    max_request_bytes: int = 2 * 2**30
    # LM state bytes one level of one lattice may create; beyond it the level keeps its best states only
    max_level_bytes: int = 64 * 2**20
    # ---- sessions (`session` on /rescore: each request after the session's last transcripts) --------
    max_sessions: int = 10_000  # open at once, per engine; creating one more answers 429
    session_ttl_s: float = 600.0  # a session without a request for this long ends
    max_context_utts: int = 8  # transcripts a session (or a request's `context`) may hold
    session_context_utts: int = 1  # a new session's default
    # ---- deadlines and timeouts -------------------------------------------------------------
    request_timeout_s: float = 30.0  # deadline of a request (from its first byte); X-Request-Timeout may shorten it
    header_timeout_s: float = 10.0  # a request's head must arrive within this (else the connection is closed)
    body_timeout_s: float = 30.0  # and its body within this after the head (else 408)
    # Worker time one batch or lattice expansion gets before the worker turns to other queued work: a long
    # job holds small ones for at most about this long.
    slice_ms: float = 50.0
    # ---- processes ------------------------------------------------------------------------
    # Front-end processes (HTTP, preparing work, ranking, answers); None: one per CPU this process may use
    # (affinity and cgroup quota), less one for the engine, at least 1 (docs/service.md, "Processes").
    frontends: int | None = None
    # how long the supervisor waits for a dead front-end's replacement, or a dead engine's, to start again
    restart_delay_s: float = 0.2
    # ---- shutdown -------------------------------------------------------------------------
    drain_seconds: float = 1.0  # after SIGTERM: /readyz answers 503 this long before the listener closes
    graceful_timeout_s: float = 30.0  # then in-flight requests get this long to finish

    def __post_init__(self) -> None:
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ConfigError(f"setting batch_tokens must be >= 1, got {self.batch_tokens}")
        positive = ("max_states", "lattice_nbest", "max_batch_tokens", "max_queue", "max_body_bytes",
                    "max_utterances", "max_hypotheses", "max_words", "max_lattice_arcs", "max_nbest", "max_per_state",
                    "max_ngram_order", "max_trie_nodes", "max_lattice_cost", "max_request_bytes", "max_level_bytes",
                    "max_sessions")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_wait_ms", "drain_seconds", "graceful_timeout_s", "restart_delay_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"setting {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.session_context_utts <= self.max_context_utts:
            raise ConfigError(f"setting session_context_utts must lie in [0, max_context_utts = "
                              f"{self.max_context_utts}], got {self.session_context_utts}")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s", "slice_ms", "max_request_seconds",
                     "session_ttl_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"setting {name} must be positive and finite, got {getattr(self, name)}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"setting precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.beam <= 0:
            raise ConfigError(f"setting beam must be > 0, got {self.beam}")
        if self.frontends is not None and self.frontends < 1:
            raise ConfigError(f"setting frontends must be >= 1, got {self.frontends}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"setting threads must be >= 1, got {self.threads}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"setting port must lie in 0..65535, got {self.port}")
        if self.lattice_nbest > self.max_nbest:
            raise ConfigError(f"setting lattice_nbest ({self.lattice_nbest}) exceeds max_nbest ({self.max_nbest})")
        self.log_level = self.log_level.lower()
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ConfigError(f"setting log_level must be critical, error, warning, info, debug or trace, "
                              f"got {self.log_level!r}")
        if self.api_key is not None and not self.api_key.strip():
            self.api_key = None  # an empty SMALLSTATE_API_KEY means no key, not "accept an empty bearer"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, assignments: Sequence[str] = (),
                 **overrides) -> "Settings":
        """Defaults, then `SMALLSTATE_<NAME>` variables, then `name=value` assignments (strings,
        parsed like the variables), then `overrides` that are not None."""
        env = os.environ if env is None else env
        hints = typing.get_type_hints(cls)
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(raw, hints[f.name], ENV_PREFIX + f.name.upper())
        for item in assignments:
            name, eq, raw = item.partition("=")
            name = name.strip()
            if not eq or name not in hints:
                raise ConfigError(f"--set {item!r}: expected name=value with a setting name "
                                  f"({', '.join(f.name for f in fields(cls))})")
            values[name] = _parse(raw, hints[name], f"--set {name}")
        unknown = [k for k in overrides if k not in hints]
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


def _parse(raw: str, hint, name: str):
    """An environment string as the field's type; errors name the variable."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    if raw.strip() == "" and type(None) in typing.get_args(hint):
        return None
    try:
        if base is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected {getattr(base, '__name__', base)}") from None
    return raw
