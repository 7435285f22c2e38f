"""ModelConfig and the named presets.

A checkpoint stores the config as a plain dict, so `ModelConfig.from_dict` must
rebuild exactly the model that was saved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError


@dataclass
class ModelConfig:
    arch: Literal["transformer"] = "transformer"
    vocab_size: int = 0  # filled in from the vocabulary at training time
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 8  # attention layers (L)
    ff_per_layer: int = 3  # feed-forward sublayers after each attention layer (F)
    d_ff: int = 4096
    d_embed: int | None = 128  # None: embeddings are d_model wide, no projection
    shared_kv: bool = False  # one projection for keys and values; only keys are stored
    pos: Literal["none"] = "none"
    dropout: float = 0.1
    tie_embeddings: bool = True
    softmax: Literal["full", "adaptive"] = "full"
    adaptive_cutoffs: list[int] = field(default_factory=list)  # adaptive softmax cluster edges
    layer_norm_eps: float = 1e-5
    bias: bool = True  # biases in attention and feed-forward projections (every preset sets False)

    def __post_init__(self):
        self.validate(allow_unset_vocab=True)

    @property
    def embed_dim(self) -> int:
        return self.d_embed or self.d_model

    @property
    def name(self) -> str:
        kv = "-sharedkv" if self.shared_kv else ""
        return f"{self.n_layers}L-{self.ff_per_layer}F{kv}"

    def validate(self, allow_unset_vocab: bool = False) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        need(self.arch == "transformer", f"unknown arch {self.arch!r}")
        need(allow_unset_vocab or self.vocab_size > 3, f"vocab_size must be > 3, got {self.vocab_size}")
        for name in ("d_model", "n_heads", "n_layers", "d_ff"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.ff_per_layer >= 0, f"ff_per_layer must be >= 0, got {self.ff_per_layer}")
        need(self.d_model % self.n_heads == 0,
             f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        need(self.d_embed is None or self.d_embed >= 1, f"d_embed must be >= 1, got {self.d_embed}")
        need(0.0 <= self.dropout < 1.0, f"dropout must lie in [0, 1), got {self.dropout}")
        need(self.pos == "none", f"pos must be 'none', got {self.pos!r}")
        need(self.softmax in ("full", "adaptive"), f"softmax must be 'full' or 'adaptive', got {self.softmax!r}")
        if self.softmax == "adaptive":
            need(not self.tie_embeddings, "adaptive softmax cannot tie embeddings; set tie_embeddings=False")
            cut = list(self.adaptive_cutoffs)
            need(len(cut) >= 1 and cut == sorted(set(cut)) and cut[0] > 0,
                 f"adaptive_cutoffs must be increasing positive ints, got {cut}")
            need(allow_unset_vocab or cut[-1] < self.vocab_size,
                 f"adaptive_cutoffs must be < vocab_size ({self.vocab_size}), got {cut}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**d)

    def replace(self, **overrides) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides)


# The seed paper's TED-LIUM configuration: d 768, 12 heads, d_ff 4096, 128-dim
# embeddings projected to 768, pre-LayerNorm, no positional encoding.
# Bias-free projections: no quality cost with pre-LayerNorm, and a plain matmul runs
# faster than one that first broadcasts a bias into its output.
_PAPER = dict(d_model=768, n_heads=12, d_ff=4096, d_embed=128, bias=False)

PRESETS: dict[str, ModelConfig] = {
    "8L-3F": ModelConfig(n_layers=8, ff_per_layer=3, **_PAPER),
    "8L-3F-sharedkv": ModelConfig(n_layers=8, ff_per_layer=3, shared_kv=True, **_PAPER),
    "32L-1F": ModelConfig(n_layers=32, ff_per_layer=1, **_PAPER),
    # Mid-size for CPU training runs: 4 attention layers, 2 feed-forward sublayers each.
    "small": ModelConfig(n_layers=4, ff_per_layer=2, d_model=256, n_heads=4, d_ff=1024, d_embed=128, bias=False),
    # For tests and the demo: trains in minutes on a laptop CPU.
    "tiny": ModelConfig(n_layers=2, ff_per_layer=2, d_model=64, n_heads=4, d_ff=256, d_embed=64, bias=False),
}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
