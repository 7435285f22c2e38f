"""ModelConfig and the named presets.

A checkpoint stores the config as a plain dict, so `ModelConfig.from_dict` must
rebuild exactly the model that was saved.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError

ARCHS = ("transformer", "transformer_xl", "adaptive_span", "feedback", "all_attention", "active_memory", "lstm")


@dataclass
class ModelConfig:
    arch: Literal["transformer", "transformer_xl", "adaptive_span", "feedback", "all_attention",
                  "active_memory", "lstm"] = "transformer"
    vocab_size: int = 0  # filled in from the vocabulary at training time
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 8  # attention layers (L)
    ff_per_layer: int = 3  # feed-forward sublayers after each attention layer (F)
    d_ff: int = 4096
    d_embed: int | None = 128  # None: embeddings are d_model wide, no projection
    # one projection for keys and values; only keys are stored. With rotary positions the
    # cached keys are rotated, so the values are the rotated keys: every path (full, step,
    # tree) reads values from the cache, which keeps them consistent and the state halved
    shared_kv: bool = False
    # Multiply the input embedding by sqrt(embed_dim): with the 0.02 init (and tied output
    # weights) token identities otherwise start ~20x smaller than the first sublayer's
    # output in the residual stream, which slows early training a lot
    embed_scale: bool = False
    # "rotary": rotary position embeddings on queries and keys (transformer only); the
    # seed design has none and infers order from the causal mask
    pos: Literal["none", "rotary"] = "none"
    dropout: float = 0.1
    tie_embeddings: bool = True
    softmax: Literal["full", "adaptive"] = "full"
    adaptive_cutoffs: list[int] = field(default_factory=list)  # adaptive softmax cluster edges
    layer_norm_eps: float = 1e-5
    bias: bool = True  # biases in attention and feed-forward projections (every preset sets False)
    # transformer_xl: memory positions kept per layer; feedback: memory positions kept
    # (0 = unbounded, allowed for feedback only)
    mem_len: int = 0
    # adaptive_span (and all_attention's optional span on its context): maximum span S,
    # ramp length R, span-loss coefficient, initial span as a fraction of S
    span_max: int = 0
    span_ramp: int = 32
    span_loss: float = 2e-6
    span_init: float = 0.0
    feedback_shared_kv: bool = True  # feedback: one K/V projection of the memory for all layers
    n_persistent: int = 0  # all_attention: persistent key/value vectors per head
    mixer: Literal["conv", "persistent_conv", "highway_conv", "cgru"] = "conv"  # active_memory
    mix_attention: bool = False  # active_memory: self-attention + the mixer, summed ("SA + conv")
    conv_kernel: int = 20  # active_memory: kernel width k (state keeps k-1 inputs per layer)

    def __post_init__(self):
        self.validate(allow_unset_vocab=True)

    @property
    def embed_dim(self) -> int:
        return self.d_embed or self.d_model

    @property
    def name(self) -> str:
        kv = "-sharedkv" if self.shared_kv else ""
        shape = f"{self.n_layers}L-{self.ff_per_layer}F{kv}"
        if self.arch == "transformer":
            return shape
        if self.arch == "active_memory":
            return f"{'sa+' if self.mix_attention else ''}{self.mixer.replace('_', '-')} {shape}"
        if self.arch == "lstm":
            return f"lstm {self.n_layers}x{self.d_model}"
        return f"{self.arch.replace('_', '-')} {shape}"

    def validate(self, allow_unset_vocab: bool = False) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        for f in dataclasses.fields(self):  # a string such as "False" from a command line is truthy
            value, kind = getattr(self, f.name), f.type
            if kind == "bool":
                need(isinstance(value, bool), f"{f.name} must be true or false, got {value!r}")
            elif kind in ("int", "int | None"):
                need((value is None and kind != "int") or (isinstance(value, int) and not isinstance(value, bool)),
                     f"{f.name} must be an integer{' or null' if kind != 'int' else ''}, got {value!r}")
            elif kind == "float":
                need(isinstance(value, (int, float)) and not isinstance(value, bool),
                     f"{f.name} must be a number, got {value!r}")
        need(self.arch in ARCHS, f"unknown arch {self.arch!r}; choose one of: {', '.join(ARCHS)}")
        need(allow_unset_vocab or self.vocab_size > 3, f"vocab_size must be > 3, got {self.vocab_size}")
        for name in ("d_model", "n_heads", "n_layers", "d_ff"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(self.ff_per_layer >= 0, f"ff_per_layer must be >= 0, got {self.ff_per_layer}")
        need(self.d_model % self.n_heads == 0,
             f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        need(self.d_embed is None or self.d_embed >= 1, f"d_embed must be >= 1, got {self.d_embed}")
        need(0.0 <= self.dropout < 1.0, f"dropout must lie in [0, 1), got {self.dropout}")
        need(self.pos in ("none", "rotary"), f"pos must be 'none' or 'rotary', got {self.pos!r}")
        if self.pos == "rotary":
            need(self.arch == "transformer", f"pos='rotary' is implemented for arch 'transformer' only, "
                                             f"got {self.arch!r}")
            need((self.d_model // self.n_heads) % 2 == 0,
                 f"pos='rotary' needs an even head width, got {self.d_model // self.n_heads}")
        for name in ("mem_len", "span_max", "n_persistent"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        if self.arch == "transformer_xl":
            need(self.mem_len >= 1, f"transformer_xl needs mem_len >= 1, got {self.mem_len}")
        if self.arch == "adaptive_span":
            need(self.span_max >= 1, f"adaptive_span needs span_max >= 1, got {self.span_max}")
        if self.arch in ("adaptive_span", "all_attention") and self.span_max:
            need(self.span_ramp >= 1, f"span_ramp must be >= 1, got {self.span_ramp}")
            need(0.0 <= self.span_init <= 1.0, f"span_init must lie in [0, 1], got {self.span_init}")
        if self.arch == "all_attention":
            need(self.n_persistent >= 1, f"all_attention needs n_persistent >= 1, got {self.n_persistent}")
        if self.arch == "active_memory":
            need(self.mixer in ("conv", "persistent_conv", "highway_conv", "cgru"),
                 f"mixer must be conv, persistent_conv, highway_conv or cgru, got {self.mixer!r}")
            need(self.conv_kernel >= 2, f"conv_kernel must be >= 2, got {self.conv_kernel}")
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
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        d = dict(d)
        for name, value in d.items():
            # `--set flag=False` was once kept as the text "False", and the model was built by its
            # truthiness: rebuild what was trained, and say so
            if fields[name].type == "bool" and isinstance(value, str):
                d[name] = bool(value)
                warnings.warn(f"model config field {name} holds the text {value!r} (an old --set wrote it); the "
                              f"model was built with {name}={d[name]}, and is loaded so", stacklevel=2)
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
    # Mid-size for CPU training runs: 4 attention layers, 2 feed-forward sublayers each, with
    # what made it converge per token like a plain Transformer (docs/results.md, "recipe"):
    # rotary positions, 256-dim embeddings without a projection, scaled by sqrt(256), and no
    # dropout (CPU budgets are a few epochs at most: dropout 0.1 cost 4% dev perplexity at
    # 0.86M tokens and more at 4M)
    "small": ModelConfig(n_layers=4, ff_per_layer=2, d_model=256, n_heads=4, d_ff=1024, d_embed=None, bias=False,
                         pos="rotary", embed_scale=True, dropout=0.0),
    # For tests: trains in minutes on a laptop CPU.
    "tiny": ModelConfig(n_layers=2, ff_per_layer=2, d_model=64, n_heads=4, d_ff=256, d_embed=64, bias=False),
}

# Alternative backends and baselines at the `small` budget (4 x d 256, 128-dim embeddings),
# so one CPU command line compares them with only the preset changed.
_SMALL = dict(n_layers=4, ff_per_layer=2, d_model=256, n_heads=4, d_ff=1024, d_embed=128, bias=False)
PRESETS.update({
    "xl-small": ModelConfig(arch="transformer_xl", mem_len=64, **_SMALL),
    "span-small": ModelConfig(arch="adaptive_span", span_max=128, span_ramp=16, **_SMALL),
    "feedback-small": ModelConfig(arch="feedback", mem_len=0, **_SMALL),
    # No feed-forward sublayers: persistent vectors take their place (and their parameters).
    "allatt-small": ModelConfig(arch="all_attention", **{**_SMALL, "n_layers": 8, "ff_per_layer": 0},
                                n_persistent=128),
    "conv-small": ModelConfig(arch="active_memory", mixer="conv", **_SMALL),
    "pconv-small": ModelConfig(arch="active_memory", mixer="persistent_conv", **_SMALL),
    "hconv-small": ModelConfig(arch="active_memory", mixer="highway_conv", **_SMALL),
    "cgru-small": ModelConfig(arch="active_memory", mixer="cgru", **_SMALL),
    "sa-conv-small": ModelConfig(arch="active_memory", mixer="conv", mix_attention=True, **_SMALL),
    "sa-pconv-small": ModelConfig(arch="active_memory", mixer="persistent_conv", mix_attention=True, **_SMALL),
    "sa-hconv-small": ModelConfig(arch="active_memory", mixer="highway_conv", mix_attention=True, **_SMALL),
    "sa-cgru-small": ModelConfig(arch="active_memory", mixer="cgru", mix_attention=True, **_SMALL),
    # 2 x 512 LSTM over 128-dim embeddings, output projected back to 128 and tied.
    "lstm-small": ModelConfig(arch="lstm", n_layers=2, ff_per_layer=0, d_model=512, n_heads=1, d_ff=1,
                              d_embed=128, bias=True),
})


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])
