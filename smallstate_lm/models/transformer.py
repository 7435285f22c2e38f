"""The small-state Transformer LM (Irie et al. 2020).

`n_layers` pre-LayerNorm self-attention layers, each followed by `ff_per_layer`
feed-forward sublayers with their own LayerNorm and residual; no positional
encoding (the causal mask alone orders the tokens). With `shared_kv` one projection
gives both keys and values, so the state stores keys only: n_layers × d_model
numbers per position instead of twice that.

`pos="rotary"` adds rotary position embeddings (RoPE) to queries and keys. Keys are
cached already rotated, so the state needs no new field: the position of the next
token of a row is the number of valid positions in its cache. Attention then depends
only on the distance between query and key, which keeps every cache operation that
reorders or pads positions (compact, cat, assemble) and tree attention (positions =
depth in the trie) exact.

Tree attention runs a trie in one dense pass while its (N+1) x (N+1) ancestor mask fits
the caller's memory cap; past it, in blocks of nodes that attend to their ancestors'
keys only, gathered from a table of root-to-leaf paths: memory linear in the trie
(`tree_plan` says which, and how much).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..state import LMState, length_mask
from ..vocab import BOS_ID
from .base import (
    Block,
    PendingTokenLM,
    SelfAttention,
    apply_rotary,
    causal_mask,
    embed_tokens,
    init_weights,
    rotary_table,
    tree_inputs,
)
from .config import ModelConfig
from .output import LOGIT_BUDGET


@dataclasses.dataclass(frozen=True)
class TransformerState(LMState):
    """Per-layer attention memory of the history, plus the pending token.

    keys[l], values[l]: (B, H, S, Dh) for the S positions already run through the
    model; `values` is None with shared_kv. last: (B,) the most recent token, not yet
    run through the model (its output predicts the next token, so running it is
    deferred until that token is known). mask: (B, S) bool, False at positions that
    were padding in a call with `lengths`; None when every position is valid.
    """

    keys: list[Tensor]
    values: list[Tensor] | None
    last: Tensor
    mask: Tensor | None = None

    memory_fields = ("keys", "values")

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @classmethod
    def cat(cls, states: list["TransformerState"]) -> "TransformerState":
        """Stack states along the batch; shorter histories are padded with masked
        positions, so rows of different lengths can share one forward pass."""
        if len(states) == 1:
            return states[0]
        S = max(st.length for st in states)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[2] == S else F.pad(t, (0, 0, 0, S - t.shape[2]))

        def mask_of(st: "TransformerState") -> torch.Tensor:
            B, dev = st.last.shape[0], st.last.device
            m = st.mask if st.mask is not None else torch.ones(B, st.length, dtype=torch.bool, device=dev)
            return F.pad(m, (0, S - st.length), value=False)

        n_layers = len(states[0].keys)
        keys = [torch.cat([padded(st.keys[i]) for st in states]) for i in range(n_layers)]
        values = None if states[0].values is None else [
            torch.cat([padded(st.values[i]) for st in states]) for i in range(n_layers)]
        mask = torch.cat([mask_of(st) for st in states])
        return cls(keys=keys, values=values, last=torch.cat([st.last for st in states]),
                   mask=None if bool(mask.all()) else mask)

    @classmethod
    def assemble(cls, pieces: list[tuple["TransformerState", torch.Tensor, torch.Tensor]],
                 n_rows: int) -> "TransformerState":
        """Row dst[i] of the result = row src[i] of that piece's state, for each
        (state, src, dst) piece: one copy per layer, however many states the rows come
        from (select + cat + reorder would copy every history three times)."""
        first = pieces[0][0]
        S = max(st.length for st, _, _ in pieces)
        B, H, _, Dh = n_rows, first.keys[0].shape[1], first.keys[0].shape[2], first.keys[0].shape[3]
        dev, dtype = first.last.device, first.keys[0].dtype

        def build(get):
            out = []
            for i in range(len(first.keys)):
                t = torch.zeros(B, H, S, Dh, dtype=dtype, device=dev)
                for st, src, dst in pieces:
                    t[dst, :, : st.length] = get(st)[i].index_select(0, src)
                out.append(t)
            return out

        keys = build(lambda st: st.keys)
        values = None if first.values is None else build(lambda st: st.values)
        last = torch.empty(B, dtype=torch.long, device=dev)
        mask = torch.zeros(B, S, dtype=torch.bool, device=dev)
        for st, src, dst in pieces:
            last[dst] = st.last.index_select(0, src)
            m = st.mask.index_select(0, src) if st.mask is not None else torch.ones(
                len(src), st.length, dtype=torch.bool, device=dev)
            mask[dst, : st.length] = m
        return cls(keys=keys, values=values, last=last, mask=None if bool(mask.all()) else mask)

    def compact(self) -> "TransformerState":
        """Move each row's valid positions to the front and cut the common padding.
        Exact for this model: attention over the cached keys does not depend on their
        order (rotary positions, if any, are baked into the cached keys)."""
        if self.mask is None:
            return self
        counts = self.mask.sum(1)  # (B,)
        s_new = int(counts.max()) if counts.numel() else 0
        if s_new == self.length:
            return self
        order = torch.argsort((~self.mask).to(torch.int8), dim=1, stable=True)[:, :s_new]  # (B, S_new)
        B, H, _, Dh = self.keys[0].shape
        idx = order[:, None, :, None].expand(B, H, s_new, Dh)

        def gather(ts):
            return None if ts is None else [t.gather(2, idx) for t in ts]

        new_mask = torch.arange(s_new, device=counts.device)[None, :] < counts[:, None]
        return TransformerState(keys=gather(self.keys), values=gather(self.values), last=self.last,
                                mask=None if bool(new_mask.all()) else new_mask)


# On a CPU, blocks replace a dense pass that fits when they move at most this share of its bytes. Bytes are a
# rough proxy for time: dev 50-best lists of 1-16 utterances (AMD EPYC, one thread) ran within 15% either way
# where the two moved about as much, and blocks won by 1.46x (16 lists, 4L tiny model) where they moved 0.76x.
# Not on a GPU, where kernel launches, not bytes, bound a model of this size and blocks launch more: the H100
# suite run with this choice everywhere scored the dev lists' tries at 311k tokens/s against 361k the run
# before (padded rows, untouched, 537k against 546k).
BLOCKED_PAYS = 0.85


@dataclasses.dataclass(frozen=True)
class TreePlan:
    """How `score_tree` runs a batch of tries under a memory cap: one dense pass, or
    (`blocked`) its positions in blocks of `block` queries, each attending to its
    ancestors only. `nbytes` bounds the tensors the call holds at once, its inputs and
    output included; above the cap it is the smallest plan's (the batch cannot run)."""

    blocked: bool
    block: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class TreeForest:
    """The tries of a `score_tree` batch as one forest of M positions without padding:
    each row's `<s>` (a root), then its real nodes.

    inputs (M,): token ids, `<s>` at roots. up (M,): each position's parent; a root is
    its own. depth (M,): 0 at roots. node (R,): the position of each real node, in the
    order of `real.nonzero()`. paths (P,): every leaf's positions from its root down,
    concatenated. path_start (M,): where a path through each position starts in `paths`,
    so that its ancestor at depth j is paths[path_start + j]."""

    inputs: Tensor
    up: Tensor
    depth: Tensor
    node: Tensor
    paths: Tensor
    path_start: Tensor


def forest_depths(up: Tensor) -> Tensor:
    """(M,) each position's number of ancestors in the forest `up` (M,) (roots are their
    own parent), by pointer jumping: log2(depth) rounds over M positions."""
    depth = (up != torch.arange(len(up), device=up.device)).long()  # (M,) steps to `jump`
    jump = up
    while True:
        nxt = jump[jump]
        if bool((nxt == jump).all()):  # every position jumps to its root
            return depth
        depth = depth + depth[jump]
        jump = nxt


def tree_forest(tokens: Tensor, par: Tensor, real: Tensor) -> TreeForest:
    """The `TreeForest` of tokens (B, N), par (B, N) (parent positions, 0 = `<s>`) and
    real (B, N) (a length mask: real nodes come first in their row)."""
    dev = tokens.device
    counts = real.sum(1) + 1  # (B,) positions of a row: its <s> and its real nodes
    starts = torch.cumsum(counts, 0) - counts  # (B,) the position of each row's <s>
    M = int(counts.sum())
    b_idx, n_idx = real.nonzero(as_tuple=True)  # (R,)
    node = starts[b_idx] + 1 + n_idx  # (R,)
    inputs = torch.full((M,), BOS_ID, dtype=torch.long, device=dev)
    inputs[node] = tokens[b_idx, n_idx]
    up = torch.arange(M, device=dev)
    up[node] = starts[b_idx] + par[b_idx, n_idx]
    depth = forest_depths(up)
    has_child = torch.zeros(M, dtype=torch.bool, device=dev)
    has_child[up[node]] = True
    leaf = (~has_child).nonzero()[:, 0]  # (L,)
    size = depth[leaf] + 1  # (L,) positions on each leaf's path
    leaf_start = torch.cumsum(size, 0) - size  # (L,)
    paths = torch.empty(int(size.sum()), dtype=torch.long, device=dev)
    path_start = torch.empty(M, dtype=torch.long, device=dev)
    cur = leaf
    # All leaves climb at once; one that has reached its root writes the root again (harmless).
    for _ in range(int(size.max())):
        paths[leaf_start + depth[cur]] = cur
        path_start[cur] = leaf_start  # any leaf below a position serves it
        cur = up[cur]
    return TreeForest(inputs, up, depth, node, paths, path_start)


def rope_rows(positions: Tensor, table: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Rotary tables for a flat list of positions (Q,), gathered from `table` (`rotary_table`
    of more positions than the largest): (cos, sin), each (Q, 1, dh), to rotate (Q, H, dh)
    queries or keys."""
    return table[0][positions, None], table[1][positions, None]  # (Q, 1, dh)


# score_tree's bytes per (row, node) for its int64 inputs, their masked copies and the
# float output (with the float64 copy a caller makes of it).
TREE_ROW_BYTES = 80
# Bytes per forest position for its index tables and their temporaries (sort, nonzero).
TREE_FOREST_BYTES = 192


def make_layer(cfg: ModelConfig) -> Block:
    """One self-attention sublayer followed by `ff_per_layer` feed-forward sublayers."""
    return Block(cfg, SelfAttention(cfg))


class TransformerLM(PendingTokenLM):
    """The small-state Transformer (see the module doc); the only family with tree
    attention (`score_tree`)."""

    def __init__(self, cfg: ModelConfig):
        cfg.validate()
        super().__init__(cfg, make_layer)
        self.apply(init_weights)

    # ---- the state contract ----------------------------------------------------------
    def state_numel_per_position(self) -> int:
        return self.cfg.n_layers * self.cfg.d_model * (1 if self.cfg.shared_kv else 2)

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> TransformerState:
        """The state after `<s>`: nothing cached yet, `<s>` pending. No compute."""
        dtype, device = self.state_placement(device)
        H, Dh = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        shape = (batch_size, H, 0, Dh)
        return TransformerState(
            keys=[torch.empty(shape, dtype=dtype, device=device) for _ in self.layers],
            values=None if self.cfg.shared_kv else [torch.empty(shape, dtype=dtype, device=device)
                                                    for _ in self.layers],
            last=torch.full((batch_size,), BOS_ID, dtype=torch.long, device=device),
        )

    def score_tree(self, tokens: Tensor, parents: Tensor, lengths: Tensor | None = None,
                   max_work_bytes: int | None = None, plan: TreePlan | None = None) -> Tensor:
        """Score a prefix trie in one pass ("tree attention"): every node attends to
        itself and its ancestors only, which is exact here because the model has no
        positional encoding, or rotary positions taken from each node's depth.

        tokens: (B, N) the nodes of each row's trie, parents before children.
        parents: (B, N) index of each node's parent in the same row, -1 for nodes
        that follow `<s>` directly. lengths: optional (B,) number of real nodes.
        max_work_bytes: cap on the working memory (see `tree_plan`); None: one dense
        pass whatever the size. ValueError when even blocks of one query exceed it.
        plan: `tree_plan`'s for this batch and cap, when the caller knows it (saves
        working out the tries' depths when the plan is the dense pass).
        Returns (B, N) natural-log p(node token | <s>, ancestors); 0 at padding.
        """
        B, N = tokens.shape
        tokens, par, real, lengths = tree_inputs(tokens, parents, lengths)
        n_real = int(lengths.sum())
        if max_work_bytes is None or B == 0 or (plan is not None and not plan.blocked):
            return self._score_tree_dense(tokens, par, real)
        forest = tree_forest(tokens, par, real)
        plan = self.tree_plan(B, N, n_real, int(forest.depth.max()), len(forest.paths), max_work_bytes)
        if plan.nbytes > max_work_bytes:
            raise ValueError(f"these tries need {plan.nbytes} bytes of working memory even in blocks of one "
                             f"node, more than max_work_bytes={max_work_bytes}")
        if not plan.blocked:
            return self._score_tree_dense(tokens, par, real)
        return self._score_tree_blocked(forest, real, plan.block)

    # ---- what tree attention costs ---------------------------------------------------
    def tree_plan(self, n_rows: int, max_nodes: int, total_nodes: int, max_depth: int, path_len: int,
                  max_work_bytes: int | None = None) -> TreePlan:
        """The plan `score_tree` follows, known before any work, for `n_rows` tries padded to
        `max_nodes` nodes with `total_nodes` real nodes in all, the deepest node at
        `max_depth` (1 right after `<s>`), and `path_len` = the sum over their leaves of
        depth + 1 (1 for an empty trie). Without a cap the dense pass; with one, the dense
        pass when it fits (on a CPU: unless the largest blocks that fit move clearly fewer
        bytes, BLOCKED_PAYS), else those blocks. The dense pass grows with the square of the
        nodes per row, the blocks with nodes times depth: on a CPU, wide shallow tries (an
        n-best list's) go faster in blocks when the model is small enough that attention, not
        the layers' matmuls, dominates."""
        dense = self._dense_tree_bytes(n_rows, max_nodes, total_nodes)
        if max_work_bytes is None:
            return TreePlan(False, 0, dense)
        blocked, traffic = self._blocked_plan(n_rows, max_nodes, total_nodes, max_depth, path_len, max_work_bytes)
        blocks_pay = self.norm.weight.device.type == "cpu" and traffic <= BLOCKED_PAYS * dense
        if dense <= max_work_bytes and (blocked.nbytes > max_work_bytes or not blocks_pay):
            return TreePlan(False, 0, dense)
        return blocked

    def _blocked_plan(self, n_rows: int, max_nodes: int, total_nodes: int, max_depth: int, path_len: int,
                      max_work_bytes: int) -> tuple[TreePlan, int]:
        """The blocked plan with the largest blocks under the cap, and the bytes all its blocks move."""
        c = self.cfg
        M = total_nodes + n_rows  # forest positions: every real node and each row's <s>
        fixed = (TREE_ROW_BYTES * n_rows * max_nodes + TREE_FOREST_BYTES * M + 8 * path_len
                 + 4 * c.d_model * (2 if c.shared_kv else 3) * M  # the stream and one layer's keys (values)
                 + 4 * c.vocab_size * (c.embed_dim + 1))  # the output layer's augmented weight
        # a query's ancestor slot: its indices and mask, gathered key (and value) plus the copy
        # attention may make, float mask, and per head score and probability
        slot = 29 + 8 * c.n_heads + 8 * c.d_model * (1 if c.shared_kv else 2)
        per_query = self._tree_position_bytes() + slot * (max_depth + 1)
        # A block's logits: one row per query, but the output layer holds at most `rows` at once.
        logit_row, rows = 4 * c.vocab_size, max(1, LOGIT_BUDGET // c.vocab_size)
        block = (max_work_bytes - fixed) // (per_query + logit_row)
        if block > rows:
            # Larger blocks: fewer passes per layer, and fewer multithreaded regions, each of
            # which waits for its slowest thread when other work shares the cores.
            block = (max_work_bytes - fixed - logit_row * rows) // per_query
        block = max(1, min(M, block))
        plan = TreePlan(True, block, fixed + block * per_query + logit_row * min(block, rows))
        return plan, fixed + M * per_query + logit_row * min(M, rows)

    def _dense_tree_bytes(self, n_rows: int, max_nodes: int, total_nodes: int) -> int:
        """Bytes of the dense pass over `n_rows` tries padded to `max_nodes` nodes: per (row,
        query, key) the bool ancestor mask, the float mask attention makes of it, and per head
        the scores and their softmax where the kernel materialises them (the math path does)."""
        c, n_pos = self.cfg, n_rows * (max_nodes + 1)
        logit_rows = min(total_nodes, max(1, LOGIT_BUDGET // c.vocab_size))
        return (n_pos * (max_nodes + 1) * (5 + 8 * c.n_heads) + n_pos * self._tree_position_bytes()
                + TREE_ROW_BYTES * n_rows * max_nodes + 4 * total_nodes * (2 * c.d_model + 2 * c.embed_dim + 7)
                + 4 * logit_rows * c.vocab_size + 4 * c.vocab_size * (c.embed_dim + 1))

    def _tree_position_bytes(self) -> int:
        """Activations per position of one layer (and the embedding and output): the stream,
        its norm, q, k, v, their rotations, attention output and its reshape, the
        feed-forward hidden layer, rotary tables; generous, as an upper bound."""
        c = self.cfg
        return 4 * (16 * c.d_model + c.d_ff + 2 * c.embed_dim + 4 * (c.d_model // c.n_heads))

    # ---- tree attention ------------------------------------------------------------
    def _score_tree_dense(self, tokens: Tensor, par: Tensor, real: Tensor) -> Tensor:
        """score_tree in one pass over each row's whole trie, with an (N+1) x (N+1)
        ancestor-or-self mask. tokens, par, real: (B, N) as prepared by score_tree."""
        B, N = tokens.shape
        dev = tokens.device
        inputs = torch.cat([torch.full((B, 1), BOS_ID, dtype=torch.long, device=dev), tokens], 1)  # (B, N+1)
        # ancestor-or-self mask, built by walking every node up to <s> (depth steps)
        up = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), par], 1)  # (B, N+1) parent of each position
        mask = torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=dev)
        cur = torch.arange(N + 1, device=dev).expand(B, N + 1).clone()  # (B, N+1)
        for _ in range(N + 1):
            mask.scatter_(2, cur[:, :, None], True)
            if not bool(cur.any()):
                break
            cur = up.gather(1, cur)
        x = embed_tokens(self, inputs)
        x = self.drop(x)  # (B, N+1, d)
        attn_mask = mask[:, None]  # (B, 1, N+1, N+1)
        H, Dh = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        # a node's position is its depth: <s> at 0, as in a sequence scored from the start
        rope = None
        if self.cfg.pos == "rotary":
            cos, sin = rotary_table(N + 1, Dh, dev)
            depth = mask.sum(-1) - 1  # (B, N+1)
            rope = cos[depth][:, None], sin[depth][:, None]  # (B, 1, N+1, Dh) each
        empty = torch.empty(B, H, 0, Dh, dtype=x.dtype, device=dev)
        for layer in self.layers:
            x, _, _ = layer(x, empty, None if self.cfg.shared_kv else empty, attn_mask, False, rope)
        h = self.norm(x)  # (B, N+1, d)
        # Only real nodes go through the output layer: padding would cost a full vocabulary row each.
        b_idx, n_idx = real.nonzero(as_tuple=True)  # (R,), (R,)
        h_par = h[b_idx, par[b_idx, n_idx]]  # (R, d) output at each real node's parent
        logp = torch.zeros(B, N, dtype=torch.float32, device=dev)
        logp[b_idx, n_idx] = self.output.target_logprob(h_par, tokens[b_idx, n_idx])
        return logp

    def _score_tree_blocked(self, f: TreeForest, real: Tensor, block: int) -> Tensor:
        """score_tree over the forest `f` in blocks of `block` positions: per layer every
        position's keys (and values), then each block of queries attends to its own
        ancestors only. Nothing grows with the square of the trie. Returns (B, N)."""
        M, dev = len(f.inputs), f.inputs.device
        x = torch.empty(M, self.cfg.d_model, dtype=self.norm.weight.dtype, device=dev)  # (M, d) the stream
        for s in range(0, M, block):
            x[s : s + block] = self.drop(embed_tokens(self, f.inputs[s : s + block]))
        # queries of equal depth share a block, so a block gathers few padded ancestor slots
        order = torch.argsort(f.depth, stable=True)  # (M,)
        # one table for every layer and block, indexed by depth
        table = (rotary_table(int(f.depth.max()) + 1, self.cfg.d_model // self.cfg.n_heads, dev)
                 if self.cfg.pos == "rotary" else None)
        keys = values = None
        for layer in self.layers:
            keys, values = self._tree_keys(layer, x, f.depth, block, keys, values, table)
            for s in range(0, M, block):
                q = order[s : s + block]
                x[q] = self._tree_attend(layer, x[q], f, q, keys, values, table)
        keys = values = None
        node_logp = torch.empty(len(f.node), dtype=torch.float32, device=dev)  # (R,)
        for s in range(0, len(f.node), block):
            nodes = f.node[s : s + block]
            # the output at a node's parent predicts it; LayerNorm is per row, so norm after gathering
            node_logp[s : s + block] = self.output.target_logprob(self.norm(x[f.up[nodes]]), f.inputs[nodes])
        logp = torch.zeros(real.shape, dtype=torch.float32, device=dev)  # (B, N)
        logp[real] = node_logp  # f.node follows real.nonzero(), i.e. row-major order
        return logp

    def _tree_keys(self, layer: Block, x: Tensor, depth: Tensor, block: int, keys: Tensor | None,
                   values: Tensor | None, table: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor | None]:
        """Every position's keys and values (None with shared_kv) for `layer`, each (M, H, Dh),
        written block by block into the buffers of the layer before (None: new ones); `table`:
        rotary tables by depth (`rotary_table`), None without rotary positions."""
        attn = layer.attn
        for s in range(0, len(x), block):
            h = layer.norm(x[s : s + block])  # (C, d)
            k = attn.k(h).view(len(h), attn.h, attn.dh)  # (C, d) -> (C, H, Dh)
            if self.cfg.pos == "rotary":
                k = apply_rotary(k, *rope_rows(depth[s : s + block], table))
            if keys is None:
                keys = k.new_empty(len(x), attn.h, attn.dh)
            keys[s : s + block] = k
            if attn.v is not None:
                v = attn.v(h).view(len(h), attn.h, attn.dh)  # (C, d) -> (C, H, Dh)
                if values is None:
                    values = v.new_empty(len(x), attn.h, attn.dh)
                values[s : s + block] = v
        return keys, values

    def _tree_attend(self, layer: Block, xq: Tensor, f: TreeForest, q_pos: Tensor, keys: Tensor,
                     values: Tensor | None, table: tuple[Tensor, Tensor] | None) -> Tensor:
        """`layer` for the queries at positions q_pos (Q,) with stream rows xq (Q, d): each
        attends to its ancestors and itself, gathered through the path table; `table` as in
        `_tree_keys`. Returns (Q, d)."""
        attn = layer.attn
        Q, d = xq.shape
        q = attn.q(layer.norm(xq)).view(Q, attn.h, attn.dh)  # (Q, d) -> (Q, H, Dh)
        depth = f.depth[q_pos]  # (Q,)
        if self.cfg.pos == "rotary":
            q = apply_rotary(q, *rope_rows(depth, table))
        slots = torch.arange(int(depth.max()) + 1, device=xq.device)  # (Dq,) ancestor depths, <s> first
        valid = slots[None] <= depth[:, None]  # (Q, Dq)
        anc = f.paths[torch.where(valid, f.path_start[q_pos, None] + slots, 0)].view(-1)  # (Q, Dq) -> (Q*Dq,)
        # index_select: a plain row gather, faster on CPU than advanced indexing
        k = keys.index_select(0, anc).view(Q, -1, attn.h, attn.dh).transpose(1, 2)  # (Q*Dq, H, Dh) -> (Q, H, Dq, Dh)
        v = k if values is None else values.index_select(0, anc).view(Q, -1, attn.h, attn.dh).transpose(1, 2)  # as k
        y = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None],
                                           dropout_p=attn.dropout if self.training else 0.0)  # (Q, H, 1, Dh)
        return layer.residual(attn.o(y.reshape(Q, d)), xq)  # (Q, H, 1, Dh) -> (Q, d)

    # ---- internals -----------------------------------------------------------------
    def _run(self, tokens, state: TransformerState, lengths, include_last: bool):
        """Run the pending token and tokens[:, :-1] (plus tokens[:, -1] when
        include_last) through the model; returns hidden (B, T or T+1, d) and the new
        state, whose cache holds only the T inputs that precede each new target."""
        B, T = tokens.shape
        run = self.pending_inputs(tokens, state.last, lengths, include_last)  # (B, n_run)
        n_run = run.shape[1]
        # Row b's inputs are valid up to lengths[b] (exclusive); the extra last column
        # of `step` is only read out, never cached.
        n_cache = T
        valid_new = length_mask(lengths, n_cache) if lengths is not None else None  # (B, T)

        S = state.length
        mask, causal = causal_mask(state.mask, S, n_run, tokens.device)

        x = embed_tokens(self, run)
        x = self.drop(x)  # (B, n_run, d)
        rope = None
        if self.cfg.pos == "rotary":
            new = torch.arange(n_run, device=tokens.device)[None]  # (1, n_run)
            # Without padding in the cache every row is at the same position: one row of tables
            # broadcasts over the batch instead of B rows of cos and sin.
            positions = S + new if state.mask is None else state.mask.sum(1)[:, None] + new  # (1 or B, n_run)
            cos, sin = rotary_table(S + n_run, self.cfg.d_model // self.cfg.n_heads, tokens.device)
            rope = cos[positions][:, None], sin[positions][:, None]  # (1 or B, 1, n_run, Dh) each
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            past_v = None if state.values is None else state.values[i]
            x, k, v = layer(x, state.keys[i], past_v, mask, causal, rope)
            keys.append(k[:, :, : S + n_cache])
            if v is not None:
                values.append(v[:, :, : S + n_cache])
        h = self.norm(x)

        if lengths is None:
            new_mask = None if state.mask is None else torch.cat(
                [state.mask, torch.ones(B, n_cache, dtype=torch.bool, device=tokens.device)], 1)
        else:
            hist = state.mask if state.mask is not None else torch.ones(B, S, dtype=torch.bool, device=tokens.device)
            new_mask = torch.cat([hist, valid_new], 1)
        new_state = TransformerState(keys=keys, values=None if state.values is None else values,
                                     last=self.next_pending(tokens, state.last, lengths), mask=new_mask)
        return h, new_state

