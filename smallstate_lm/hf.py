"""A Hugging Face causal LM behind our state contract (`--lm hf:DIR`): a local directory holding any
`AutoModelForCausalLM` (safetensors weights) and its tokenizer.

Ids: ours 0, 1, 2 are the tokenizer's BOS, EOS and unknown token (`<s>`, `</s>`, `<unk>` to the rest of the
project); the tokenizer's id i is our i + 3. A word is cut as the tokenizer cuts it after a space, so every
word has one piece sequence wherever it stands (GPT-2's " word", a SentencePiece model's "▁word"); a
sentence's pieces are its words' end to end, and a word's log-probability is the sum of its pieces'.

The state is the model's own key/value cache (per layer, (B, heads, S, head_dim)), a mask of the cache
columns each row really holds, each row's next position, and its pending token (run with the next call, as
in our own models: its output predicts the next token). Rows of one batch differ in length: their padding
stays in the cache as masked columns (`compact` drops the columns no row holds), positions are per row.
Prefix sharing (`score_tree`) runs a trie in one forward with a 4-D ancestor mask and positions = depth,
for the architectures where that is exact (TREE_TYPES); others fall back to padded rows.

`transformers` is an optional dependency (`pip install smallstate-lm[hf]`), imported only here.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from .errors import CheckpointError, ConfigError, WorkLimitError
from .models.base import PendingTokenLM, tree_inputs
from .models.transformer import TreePlan
from .state import LMState, check_tokens, length_mask
from .subword import PieceVocabulary
from .vocab import SPECIALS

SHIFT = len(SPECIALS)  # the tokenizer's id i is our i + SHIFT
# model_type values whose attention takes a 4-D mask and explicit position ids as they are (tested)
TREE_TYPES = frozenset({"gpt2", "llama"})
# On a CPU the 4-D mask's dense attention (square in the nodes) outgrows what sharing saves past a few hundred
# nodes per row: dev 50-best tries run as sub-tries of at most this many (docs/benchmarks.md, "bench_hf")
CPU_TREE_NODES = 128
log = logging.getLogger(__name__)


class HFVocabulary(PieceVocabulary):
    """A Hugging Face tokenizer's pieces as the LM's tokens. A word is out of vocabulary when a piece of it is the
    unknown token (a byte-level tokenizer has none: every word is encodable)."""

    def __init__(self, tokenizer, name: str):
        self.tok = tokenizer
        self.spec = f"hf:{name}"
        self.lowercase = False
        specials = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id]
        if specials[0] is None and specials[1] is None:
            raise ConfigError(f"{self.spec}: the tokenizer defines neither a BOS nor an EOS token")
        # a tokenizer without BOS starts sentences with EOS (GPT-2's convention) and vice versa
        bos = specials[0] if specials[0] is not None else specials[1]
        eos = specials[1] if specials[1] is not None else specials[0]
        self.special_ids = (bos, eos, specials[2] if specials[2] is not None else eos)
        self.unk_piece = None if specials[2] is None else specials[2] + SHIFT
        n = len(tokenizer)
        self.words = list(SPECIALS) + [f"#{i}" for i in range(n)]  # ids only: pieces are not words
        self.index = {}
        # the tokenizer's pieces of a word after a space: the difference between "x" and "x word", so that a
        # tokenizer adding its own prefix space (SentencePiece) and one that does not (GPT-2) cut alike
        self._lead = tokenizer.encode("x", add_special_tokens=False)
        self._pieces: dict[str, tuple[int, ...]] = {}

    def _cut(self, word: str) -> tuple[int, ...]:
        ids = self.tok.encode("x " + word, add_special_tokens=False)
        if ids[: len(self._lead)] != self._lead:  # the word merged into the lead: encode it alone
            ids = self._lead + self.tok.encode(" " + word, add_special_tokens=False)
        return tuple(i + SHIFT for i in ids[len(self._lead):])

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [SPECIALS[i] if i < SHIFT else self.tok.convert_ids_to_tokens(i - SHIFT) for i in ids]

    def sample_words(self) -> list[str]:
        """The tokenizer's pieces that are whole words after a space (one token each)."""
        out = []
        for i in range(len(self.words) - SHIFT):
            w = self.tok.decode([i]).strip()
            if w.isalpha() and self.pieces(w) == (i + SHIFT,):
                out.append(w)
        return out

    def to_dict(self) -> dict:
        return {"tokenizer": {"kind": "hf", "spec": self.spec}}

    def save(self, path: str | os.PathLike) -> None:
        raise ConfigError(f"{self.spec}: a Hugging Face tokenizer stays in its own directory")


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """What the rest of the project reads of a model's config (sizes for cost estimates, a name)."""

    name: str
    model_type: str
    vocab_size: int  # ours: the tokenizer's + SHIFT
    d_model: int
    d_ff: int
    n_heads: int
    n_layers: int
    max_positions: int | None
    arch: str = "hf"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class HFState(LMState):
    """keys/values: per layer (B, H, S, Dh); mask (B, S) bool, the columns a row holds (None: all); pos (B,)
    the next position of each row; last (B,) the pending token (ours)."""

    keys: list
    values: list
    mask: Tensor | None
    pos: Tensor
    last: Tensor

    memory_fields = ("keys", "values")

    @classmethod
    def cat(cls, states: list[HFState]) -> HFState:
        if len(states) == 1:
            return states[0]
        S = max(st.keys[0].shape[2] for st in states)

        def pad(t: Tensor) -> Tensor:  # masked columns in front
            extra = S - t.shape[2]
            return t if extra == 0 else torch.cat([t.new_zeros(*t.shape[:2], extra, *t.shape[3:]), t], 2)

        masks = []
        for st in states:
            B, s = st.pos.shape[0], st.keys[0].shape[2]
            m = st.mask if st.mask is not None else torch.ones(B, s, dtype=torch.bool, device=st.pos.device)
            masks.append(torch.cat([m.new_zeros(B, S - s), m], 1))
        mask = torch.cat(masks)
        n = len(states[0].keys)
        return HFState([torch.cat([pad(st.keys[i]) for st in states]) for i in range(n)],
                       [torch.cat([pad(st.values[i]) for st in states]) for i in range(n)],
                       None if bool(mask.all()) else mask,
                       torch.cat([st.pos for st in states]), torch.cat([st.last for st in states]))

    def compact(self) -> HFState:
        if self.mask is None:
            return self
        keep = self.mask.any(0)
        if bool(keep.all()):
            return self
        idx = keep.nonzero()[:, 0]
        mask = self.mask[:, idx]
        return HFState([k.index_select(2, idx) for k in self.keys], [v.index_select(2, idx) for v in self.values],
                       None if bool(mask.all()) else mask, self.pos, self.last)


class HFCausalLM(torch.nn.Module):
    """`StatefulLM` over a transformers causal LM (see the module's docstring)."""

    log_probs_all = None
    aux_loss = None
    after_step = None
    max_history = None
    max_tree_nodes: int | None = None
    max_positions: int | None = None

    def __init__(self, hf_model, vocab: HFVocabulary, name: str):
        super().__init__()
        self.hf = hf_model
        c = hf_model.config
        self.model_type = getattr(c, "model_type", "")
        self.max_positions = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", None)
        d = getattr(c, "hidden_size", None) or getattr(c, "n_embd", 0)
        heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", 1)
        self.cfg = HFConfig(name=name, model_type=self.model_type, vocab_size=len(vocab), d_model=d,
                            d_ff=getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d,
                            n_heads=heads, n_layers=getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", 0),
                            max_positions=self.max_positions)
        bos, eos, unk = vocab.special_ids
        n = len(vocab) - SHIFT
        self.register_buffer("to_hf", torch.cat([torch.tensor([bos, eos, unk]), torch.arange(n)]), persistent=False)
        self._cache_kw = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
        if self.model_type in TREE_TYPES:
            self.score_tree, self.tree_plan = self._score_tree, self._tree_plan
        else:
            self.score_tree = self.tree_plan = None
        with torch.no_grad():  # the cache's shape per layer, from one token
            probe = self._forward(torch.zeros(1, 1, dtype=torch.long), None, None, torch.zeros(1, 1, dtype=torch.long))
        self._kv_shape = [(k.shape[1], k.shape[3]) for k, _ in probe[1]]
        self._n_kv = sum(h * dh for h, dh in self._kv_shape)

    # ---- the contract -------------------------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return 2 * self._n_kv

    def state_numel_fixed(self) -> int:
        return 0

    def report(self) -> dict:
        return {}

    def initial_state(self, batch_size: int, device=None) -> HFState:
        p = next(self.hf.parameters())
        dev = p.device if device is None else torch.device(device)
        empty = [torch.zeros(batch_size, h, 0, dh, dtype=p.dtype, device=dev) for h, dh in self._kv_shape]
        return HFState(empty, list(empty), None, torch.zeros(batch_size, dtype=torch.long, device=dev),
                       torch.zeros(batch_size, dtype=torch.long, device=dev))

    def score(self, tokens: Tensor, state: HFState, lengths: Tensor | None = None) -> tuple[Tensor, HFState]:
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        B, T = tokens.shape
        if T == 0:
            return tokens.new_zeros((B, 0), dtype=torch.float32), state
        logits, new = self._run(tokens, state, lengths, include_last=False)  # (B, T, V_hf)
        out = logits.gather(2, self.to_hf[tokens][:, :, None])[:, :, 0] - torch.logsumexp(logits, -1)
        if lengths is not None:
            out = out.masked_fill(~length_mask(lengths, T), 0.0)
        return out, new

    def step(self, tokens: Tensor, state: HFState, lengths: Tensor | None = None) -> tuple[Tensor, HFState]:
        lengths = check_tokens(tokens, state, self.cfg.vocab_size, lengths)
        B, T = tokens.shape
        logits, new = self._run(tokens, state, lengths, include_last=True)  # (B, T+1, V_hf)
        idx = lengths if lengths is not None else torch.full((B,), T, device=tokens.device)
        last = torch.log_softmax(logits[torch.arange(B, device=tokens.device), idx], -1)  # (B, V_hf)
        return last.index_select(1, self.to_hf), new

    # ---- running the model --------------------------------------------------------------------
    def _forward(self, ids: Tensor, cache: list | None, mask: Tensor | None, positions: Tensor):
        """ids (B, T) the tokenizer's; cache: per layer (keys, values) or None; mask: (B, S+T) or 4-D, or None;
        positions (B, T). -> (logits (B, T, V), [(keys, values)] per layer after the call)."""
        from transformers import DynamicCache

        kw = {}
        if cache is not None and cache[0][0].shape[2] > 0:
            kw[self._cache_kw] = DynamicCache(ddp_cache_data=cache, config=self.hf.config)
        out = self.hf(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kw)
        new = out.cache if "cache" in out else out.past_key_values  # the name before transformers 5.2x
        return out.logits, [(layer.keys, layer.values) for layer in new.layers]

    def _check_positions(self, last_position: int) -> None:
        if self.max_positions is not None and last_position >= self.max_positions:
            raise WorkLimitError(f"{self.cfg.name}: a hypothesis needs position {last_position}, past the model's "
                                 f"{self.max_positions} positions (positions 0..{self.max_positions - 1}): send "
                                 "shorter hypotheses")

    def _run(self, tokens: Tensor, state: HFState, lengths: Tensor | None, include_last: bool):
        B, T = tokens.shape
        dev = tokens.device
        n = torch.full((B,), T, device=dev) if lengths is None else lengths  # real tokens per row
        inputs = PendingTokenLM.pending_inputs(tokens, state.last, lengths, include_last)
        Tin = inputs.shape[1]
        cols = torch.arange(Tin, device=dev)[None]
        cached = cols < n[:, None]  # what the new state keeps: the pending token and all but the last token
        real = cols < (n + 1 if include_last else n)[:, None]
        attend = real | (cols == 0)  # every query sees one key at least (a row that scores nothing)
        if B:
            self._check_positions(int((state.pos + n - (0 if include_last else 1)).max()))
        positions = (state.pos[:, None] + cols).clamp(max=(self.max_positions or 2**30) - 1)
        S = state.keys[0].shape[2]
        old = state.mask if state.mask is not None else torch.ones(B, S, dtype=torch.bool, device=dev)
        mask = torch.cat([old, attend], 1).long()
        ids = self.to_hf[inputs.masked_fill(~real, 0)]
        logits, kv = self._forward(ids, list(zip(state.keys, state.values)), mask, positions)
        new_mask = torch.cat([old, cached], 1)
        pending = PendingTokenLM.next_pending(tokens, state.last, lengths)
        new = HFState([k for k, _ in kv], [v for _, v in kv], None if bool(new_mask.all()) else new_mask,
                      state.pos + n, pending)
        return logits.float(), new

    # ---- prefix sharing -----------------------------------------------------------------------
    def _score_tree(self, tokens: Tensor, parents: Tensor, lengths: Tensor | None = None,
                    max_work_bytes: int | None = None, plan=None) -> Tensor:
        """A trie from `<s>` in one forward: input 0 is BOS, node i at input i + 1 attends to itself and its
        ancestors only, at position = its depth; node i's log-prob is read at its parent's output."""
        B, N = tokens.shape
        dev = tokens.device
        tokens, par, real, _ = tree_inputs(tokens, parents, lengths)
        up = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), par], 1)  # (B, N+1) parent; BOS: itself
        cur = torch.arange(N + 1, device=dev).expand(B, N + 1)
        anc = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=dev)
        depth = torch.zeros(B, N + 1, dtype=torch.long, device=dev)
        while True:  # walk every node up to BOS at once: as many steps as the deepest node
            anc.scatter_(2, cur[:, :, None], True)
            if not bool(cur.any()):
                break
            depth += cur > 0
            cur = up.gather(1, cur)
        if N:
            self._check_positions(int(depth.max()) - 1)
        ids = torch.cat([self.to_hf[torch.zeros(B, 1, dtype=torch.long, device=dev)], self.to_hf[tokens]], 1)
        # Only BOS and the nodes that are a parent run through the model: a leaf (every `</s>`) is read at its
        # parent's output and no node attends to it. Those inputs first in each row, in order.
        inner = torch.zeros(B, N + 1, dtype=torch.bool, device=dev)
        inner.scatter_(1, par.masked_fill(~real, 0), True)
        M = int(inner.sum(1).max())
        order = torch.argsort((~inner).to(torch.int8), dim=1, stable=True)[:, :M]  # (B, M) old positions
        new_of = torch.zeros(B, N + 1, dtype=torch.long, device=dev).scatter_(
            1, order, torch.arange(M, device=dev).expand(B, M))
        anc = anc.gather(1, order[:, :, None].expand(B, M, N + 1)).gather(2, order[:, None, :].expand(B, M, M))
        # additive rather than boolean: CPU attention runs a float mask in its fused kernel (~1.6x here)
        dtype = next(self.hf.parameters()).dtype
        mask = torch.zeros(anc.shape, dtype=dtype, device=dev).masked_fill_(~anc, torch.finfo(dtype).min)
        positions = depth.gather(1, order).clamp(max=(self.max_positions or 2**30) - 1)  # padding: anywhere
        # the decoder's hidden states, then the output layer only at the rows a log-prob is read from
        hidden = self.hf.base_model(input_ids=ids.gather(1, order), attention_mask=mask[:, None],
                                    position_ids=positions, use_cache=False).last_hidden_state.flatten(0, 1)
        at = (new_of.gather(1, par) + torch.arange(B, device=dev)[:, None] * M).flatten()  # each node's parent
        rows, inverse = torch.unique(at, return_inverse=True)
        logits = self.hf.get_output_embeddings()(hidden[rows]).float()  # (rows, V)
        target = self.to_hf[tokens].flatten()
        out = (logits[inverse, target] - torch.logsumexp(logits, -1)[inverse]).view(B, N)
        return out.masked_fill(~real, 0.0)

    def _tree_plan(self, n_rows: int, max_nodes: int, total_nodes: int, max_depth: int, path_len: int,
                   max_work_bytes: int | None = None):
        c, M = self.cfg, n_rows * (max_nodes + 1)
        # the output layer's logits (at most a row per node), the ancestor mask before and after it keeps the
        # parents (bool, then float per head in attention), each layer's stream and keys/values
        nbytes = 12 * M * (c.vocab_size - SHIFT) + n_rows * (max_nodes + 1) ** 2 * (1 + 4 * c.n_heads) \
            + 4 * M * (8 * c.d_model + c.d_ff + self.state_numel_per_position())
        return TreePlan(False, 0, int(nbytes))


def load_hf(path: str | os.PathLike, device="cpu", precision: str = "fp32", spec: str | None = None):
    """The model directory `path` -> a LoadedModel; every failure is one CheckpointError/ConfigError naming it
    (as `spec`, what the user wrote). Never runs code from the directory (trust_remote_code=False) and reads
    safetensors weights only."""
    from .checkpoint import LoadedModel
    from .device import pick_dtype

    dtype = pick_dtype(precision)
    path = Path(path)
    spec = spec or str(path)
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ConfigError(f"{spec}: Hugging Face LMs need transformers (pip install 'smallstate-lm[hf]')") from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise ConfigError(f"{spec}: transformers {transformers.__version__} is installed; this release supports "
                          "5.x (its key/value cache API changes between major releases)")
    if not path.is_dir():
        raise CheckpointError(f"{spec}: no such directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{spec}: no config.json: not a Hugging Face model directory")
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{spec}: no *.safetensors weights (other weight formats can run code when loaded "
                              "and are not read)")
    quiet = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{spec}: unreadable config.json ({str(e).splitlines()[0][:200]})") from None
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise CheckpointError(f"{spec}: model_type {config.model_type!r} is not a causal LM "
                                  "(AutoModelForCausalLM cannot load it)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"{spec}: no usable tokenizer ({str(e).splitlines()[0][:200]})") from None
        if not getattr(tokenizer, "is_fast", False) and not hasattr(tokenizer, "encode"):
            raise CheckpointError(f"{spec}: the tokenizer cannot encode text")
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, trust_remote_code=False, use_safetensors=True, local_files_only=True, dtype=torch.float32,
                attn_implementation="sdpa", output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{spec}: the weights do not load ({str(e).splitlines()[0][:200]})") from None
        missing = sorted(info.get("missing_keys") or [])
        if missing:  # transformers would start them from random numbers
            raise CheckpointError(f"{spec}: the weights lack {len(missing)} of the model's tensors (e.g. "
                                  f"{missing[0]}): they were saved from another architecture")
    finally:
        transformers.logging.set_verbosity(quiet)
        transformers.logging.enable_progress_bar()
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise CheckpointError(f"{spec}: the tokenizer has {len(tokenizer)} tokens but the model's embedding only "
                              f"{rows} rows: they do not belong together")
    vocab = HFVocabulary(tokenizer, path.name)
    model.to(device=device, dtype=dtype).eval()
    try:
        lm = HFCausalLM(model, vocab, str(path.name)).to(device)
    except Exception as e:  # the probe forward: a model that does not run with a key/value cache
        raise CheckpointError(f"{spec}: model_type {config.model_type!r} does not run as a causal LM with a "
                              f"key/value cache ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    lm.eval()
    if torch.device(device).type == "cpu":  # dense tree attention: sub-tries of this many nodes ran fastest here
        lm.max_tree_nodes = CPU_TREE_NODES
    if lm.score_tree is None:
        log.warning("%s: model_type %r: no prefix sharing (tree attention is tested for %s); scoring padded rows",
                    spec, lm.model_type, ", ".join(sorted(TREE_TYPES)))
    return LoadedModel(model=lm, vocab=vocab, config=lm.cfg, path=path, extra={"hf": True})

