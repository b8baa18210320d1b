"""Speculative decoding with an EAGLE-2 dynamic draft tree, verified in one target forward.

    the proposer grows a tree from the target's newest token (the root): at each of
    ``depth`` levels it expands the ``top_k`` best nodes of the level into their
    ``top_k`` most likely children, scoring nodes by cumulative draft log-probability;
    then it keeps the ``total`` best nodes (ancestors always rank above descendants).
    One target forward scores every node under a tree attention mask; the longest
    accepted path is kept and the target's cache is compacted onto it.

Greedy output equals the target's greedy output; with sampling, tree verification
(:func:`moaspec.decoding.verify.verify_tree`) keeps the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moaspec.decoding.generation import GenerationConfig, GenerationResult, LogprobCallback, PieceCallback, TextCallback
from moaspec.decoding.policy import Speculation
from moaspec.decoding.prefill import Prefill
from moaspec.decoding.sampling import probabilities
from moaspec.decoding.speculative import start
from moaspec.decoding.verify import verify_tree
from moaspec.errors import MoaspecError
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import Transformer, tree_mask

MAX_TREE = {"depth": 32, "top_k": 32, "total": 256}


@dataclass(frozen=True)
class TreeShape:
    """Defaults: the best shape measured on this CPU with the shipped drafter (BENCHMARKS.md);
    the GPU setting of the paper is depth 6, top-k 8, 62 nodes."""

    depth: int = 2  # levels of drafts below the root
    top_k: int = 2  # nodes expanded per level, children per expanded node
    total: int = 4  # nodes verified per target forward, root included

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total < 1:
            raise MoaspecError(f"a draft tree needs depth >= 1, top_k >= 1 and total >= 1, got {self.describe()}")
        # far past any useful tree (each level is a drafter call, each node a verified token), and
        # far below a size that would stall a request for minutes
        if self.depth > MAX_TREE["depth"] or self.top_k > MAX_TREE["top_k"] or self.total > MAX_TREE["total"]:
            raise MoaspecError(f"a draft tree may have depth <= {MAX_TREE['depth']}, top_k <= {MAX_TREE['top_k']} and "
                               f"total <= {MAX_TREE['total']} (the paper's GPU tree: 6, 8, 62), got {self.describe()}")

    def describe(self) -> str:
        return f"depth {self.depth}, top_k {self.top_k}, total {self.total}"


@dataclass
class DraftTree:
    """Nodes in an order where parents come before children; node 0 is the root (the newest verified token)."""

    tokens: torch.Tensor  # [N]
    parents: list[int]  # parent index per node, -1 for the root
    depths: torch.Tensor  # [N], 0 for the root

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """A tree given its tokens and parents (each before its children), e.g. as a server receives one."""
        depths: list[int] = []
        for p in parents:
            depths.append(depths[p] + 1 if p >= 0 else 0)
        return cls(torch.tensor(list(tokens), dtype=torch.long), list(parents), torch.tensor(depths, dtype=torch.long))

    def graft(self, chain: Sequence[int]) -> DraftTree:
        """This tree with ``chain`` hung below the root (prompt lookup's drafts).

        The chain follows existing nodes while their tokens agree and branches off at
        the first difference, so no node gets two children with one token. New nodes
        come after the old ones (parents still before children); old indices stay.
        """
        tokens, parents, depths = self.tokens.tolist(), list(self.parents), self.depths.tolist()
        children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if p >= 0}
        node = 0
        for t in chain:
            nxt = children.get((node, t))
            if nxt is None:
                tokens.append(t)
                parents.append(node)
                depths.append(depths[node] + 1)
                nxt = children[(node, t)] = len(tokens) - 1
            node = nxt
        return DraftTree(torch.tensor(tokens, dtype=torch.long), parents, torch.tensor(depths, dtype=torch.long))

    def ancestors(self) -> torch.Tensor:
        """``[N, N]`` bool: ``[i, j]`` when node j is node i or one of its ancestors."""
        n = len(self.parents)
        anc = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] |= anc[p]
        return anc


class TreeProposer(Protocol):
    def begin(self, target_cache: KVCache, hidden: torch.Tensor) -> None: ...

    def propose_tree(self, tokens: Sequence[int], shape: TreeShape) -> DraftTree: ...

    def commit(self, verified: int, path: Sequence[int] | None = None, hidden: torch.Tensor | None = None) -> None: ...


def generate_tree(
    model: Transformer,
    tokenizer: Any,
    proposer: TreeProposer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    shape: TreeShape = TreeShape(),
    on_text: TextCallback | None = None,
    on_piece: PieceCallback | None = None,
    prefill: Prefill = Prefill(),
    on_logprobs: LogprobCallback | None = None,
    speculation: Speculation | None = None,
) -> GenerationResult:
    """Decode with one draft tree per target forward (callbacks as :func:`generate_chain`'s).

    With a ``speculation`` (:mod:`moaspec.decoding.policy`) a cycle whose tree is not expected to beat a plain
    step takes a plain step instead, and leaves the drafter alone: what such steps verify reaches it in one
    piece before its next tree.
    """
    # room for the verified tree, and for the expanded nodes a drafter with TLI writes into the cache
    room = max(shape.total, 1 + shape.depth * shape.top_k) + 1
    # by cost the drafter reads the prompt at its first tree, not before: a request that never drafts never pays
    # for it (unless a prompt cache keeps the drafter's state, which must then cover the prompt)
    run = start(model, tokenizer, proposer, prompt_ids, config, room, on_text, on_piece, prefill, on_logprobs,
                begin=speculation is None)
    cache, params, gen, tokens = run.cache, run.params, run.generator, run.tokens
    begun = speculation is None or run.resumable is not None
    # hidden states of verified positions the drafter has not been told of (the prompt's too, until it begins)
    pending: list[torch.Tensor] = [] if begun else [run.hidden[0]]
    read_s = 0.0  # the drafter's reading of the last tree's verified states: part of the next tree's drafting
    while not run.sink.done:
        n = cache.length
        fits = cache.capacity - n  # the tree must fit the cache (and the context window)
        nodes = max(1, min(shape.total, fits))
        drafted = speculation is None or speculation.plan_tree(nodes)
        if not drafted:  # a plain step: the causal one-token forward, none of a tree's bookkeeping
            t = time.perf_counter()
            out = model(torch.tensor([tokens[-1:]], device=model.device), cache)
            new = [run.next_token(out.logits[0])]
            if speculation is not None:
                speculation.timed(1, time.perf_counter() - t)
            states, scores = out.hidden[0], out.logits[0]
        else:
            t = time.perf_counter()
            with run.drafting():
                if not begun:
                    proposer.begin(cache, torch.cat(pending))
                    begun, pending = True, []
                    t = time.perf_counter()  # reading the prompt is no tree's drafting: the policy prices trees
                elif pending:
                    proposer.commit(n, None, torch.cat(pending))
                    pending = []
                tree = proposer.propose_tree(tokens, TreeShape(shape.depth, shape.top_k, nodes))
            draft_s, t = time.perf_counter() - t + read_s, time.perf_counter()
            ancestors = tree.ancestors().to(model.device)
            out = model(tree.tokens[None].to(model.device), cache, positions=n + tree.depths.to(model.device),
                        mask=tree_mask(n, ancestors))
            logits = run.adjusted(out.logits[0], tree.tokens, ancestors)
            judged = logits if params.greedy else probabilities(logits, params)
            path, nxt = verify_tree(tree.tokens, tree.parents, judged, params.greedy, gen)
            if speculation is not None:
                speculation.timed(len(tree.parents), time.perf_counter() - t)
                speculation.tree_outcome(len(path) + 1, draft_s)
            kept = torch.tensor([0] + path, device=out.logits.device)  # the root and the path: each scores the next token
            cache.compact(n, kept)
            new = [int(tree.tokens[i]) for i in path] + [nxt]
            states, scores = out.hidden[0, kept], out.logits[0, kept]
        run.verified(states)
        run.count(new)
        tokens += new
        run.accepted.append(len(new))
        if not run.sink.push(new, drafted=len(new) - 1, scores=scores):
            if not drafted:
                pending.append(states)
                continue
            t = time.perf_counter()
            with run.drafting():
                proposer.commit(cache.length, path, states)
            read_s = time.perf_counter() - t
    if pending and begun and prefill.reuse is not None:  # a prompt cache keeps the drafter's state: bring it up to date
        proposer.commit(cache.length, None, torch.cat(pending))
    return run.result()
