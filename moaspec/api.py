"""moaspec from Python: load a target and its drafter once, then generate as often as you like.

    import moaspec

    lm = moaspec.load()                                    # SmolLM2-135M-Instruct + its shipped MoA drafter
    out = lm.generate("Why is the sky blue?", max_new_tokens=128)
    print(out.text, out.tau, out.target_calls)

    lm = moaspec.load("path/to/hf-model", drafter="runs/moa/drafter", tree=moaspec.TreeShape(3, 2, 8))
    lm.generate([{"role": "user", "content": "Hi"}], temperature=0.7, seed=1, on_text=print)

The CLI's ``generate`` and ``serve`` build their decoding with :func:`decoding_strategy` too, so a
setting means the same thing from Python, from the shell and on the server.
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moaspec.chat import Message, chat_messages, encode_chat, encode_text, outside_vocabulary
from moaspec.decoding.generation import GenerationConfig, GenerationResult, PieceCallback, TextCallback
from moaspec.decoding.lookup import DEFAULT_LOOKUP
from moaspec.decoding.policy import MAX_CHAIN, MAX_NEW, Policy
from moaspec.decoding.prefill import Prefill, PromptCache
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.speculative import DEFAULT_CHAIN, DEFAULT_CONFIDENCE
from moaspec.decoding.tree import TreeShape
from moaspec.errors import MoaspecError, PromptError
from moaspec.strategy import Strategy
from moaspec.validation import whole_number

if TYPE_CHECKING:
    import torch

    from moaspec.models.loading import LoadedModel
    from moaspec.models.transformer import ChunkCallback

SHIPPED = "shipped"  # the drafter moaspec ships for the target, found by its weights' fingerprint
DrafterChoice = str | os.PathLike[str] | None  # SHIPPED, a checkpoint directory, or None for no drafter
Prompt = str | Sequence[Message] | Sequence[int]


def _warn(message: str) -> None:
    warnings.warn(message + "; get one with `moaspec data` (the target's answers) and `moaspec train`, and pass its "
                  "directory as drafter=", stacklevel=3)


def decoding_given(chain: int | None, tree: TreeShape | None, lookup: int | None, confidence: float | None) -> bool:
    """Whether any decoding option was given: without one, decoding is cost-aware (:mod:`moaspec.decoding.policy`)."""
    return chain is not None or tree is not None or lookup is not None or confidence is not None


def decoding_strategy(target: LoadedModel, drafter: DrafterChoice = SHIPPED, *, chain: int | None = None,
                      tree: TreeShape | None = None, lookup: int | None = None, confidence: float | None = None,
                      drafter_dtype: torch.dtype | str | None = None, by_cost: bool | None = None,
                      notify: Callable[[str], None] = _warn) -> Strategy:
    """How ``target`` will decode: ``drafter``'s chains of ``chain`` drafts (or its ``tree``), with up to
    ``lookup`` prompt-lookup drafts in front.

    ``by_cost`` (None: when none of ``chain``, ``tree``, ``lookup`` and ``confidence`` is given) decides each
    cycle from this host's measured costs and the request's acceptance whether to verify lookup's copy, let
    the drafter draft, or take a plain step (:mod:`moaspec.decoding.policy`); ``chain`` and ``lookup`` then cap
    what it may draft (default :data:`~moaspec.decoding.policy.MAX_CHAIN` and 15). Without it chains are
    always ``chain`` long (default 2), after lookup's copy where there is one (default 10). Without a
    drafter, ``lookup`` defaults to 0.

    ``drafter_dtype``: the drafter's precision, a torch dtype or a name ``--drafter-dtype`` takes
    ("int8" too); ``None`` is "auto" (or ``$MOASPEC_DRAFTER_DTYPE``).

    A target for which no drafter ships decodes with prompt lookup alone rather than failing: ``notify`` is
    told why (a warning by default), since output is the same and only speed differs.
    """
    if by_cost is None:
        by_cost = not decoding_given(chain, tree, lookup, confidence)
    chain = (MAX_CHAIN if by_cost else DEFAULT_CHAIN) if chain is None else chain
    confidence = DEFAULT_CONFIDENCE if confidence is None else confidence
    if lookup is None:
        lookup = 0 if drafter is None else MAX_NEW - 1 if by_cost else DEFAULT_LOOKUP
    if drafter is None:
        return Strategy(lookup=lookup, policy=_policy(target, None, None) if by_cost and lookup else None)
    if drafter == SHIPPED:
        from moaspec.drafters import shipped_drafter

        path = shipped_drafter(target)
        if path is None:
            how = f"prompt lookup alone (lookup {lookup})" if lookup else "plain decoding"
            from moaspec.models.sources import model_name

            notify(f"no drafter ships for {model_name(target.path)}; decoding with {how}")
            return Strategy(lookup=lookup, policy=_policy(target, None, None) if by_cost and lookup else None)
    else:
        path = Path(drafter)
    from moaspec.drafters import load_drafter

    loaded = load_drafter(path, target, drafter_dtype)
    return Strategy(loaded, chain=chain, tree=tree, lookup=lookup, confidence=confidence,
                    policy=_policy(target, path, loaded) if by_cost else None)


def _policy(target: LoadedModel, path: Path | None, drafter: Any) -> Policy:
    from moaspec.costs import policy_for

    return policy_for(target, path, drafter)


def encode_prompt(target: LoadedModel, prompt: Prompt, system: str | None = None, raw: bool = False) -> list[int]:
    """Prompt token ids from a user message (put in the chat template, or as plain text when ``raw``), a
    whole conversation (``[{"role": ..., "content": ...}, ...]``), or token ids taken as they are."""
    if isinstance(prompt, str):
        if raw:
            if system is not None:
                raise PromptError("a system message goes into the chat template, which raw text leaves out: "
                                  "give the system message or raw, not both")
            return encode_text(target.tokenizer, prompt)
        return encode_chat(target.tokenizer, chat_messages(prompt, system))
    if not isinstance(prompt, Iterable):
        raise PromptError(f"a prompt is a string, a list of {{'role', 'content'}} messages, or a list of token ids; "
                          f"got {type(prompt).__name__}")
    items: list[Any] = list(prompt)  # checked below: messages by encode_chat, ids by operator.index
    if not items:
        raise PromptError("the prompt is empty")
    if isinstance(items[0], dict):
        if system is not None or raw:
            raise PromptError("a conversation carries its own system message and chat template: a system message "
                              "or raw text applies to a single prompt string")
        return encode_chat(target.tokenizer, items)
    try:
        ids = [operator.index(t) for t in items if not isinstance(t, bool)]
    except TypeError:
        ids = []
    if len(ids) != len(items):
        raise PromptError("a prompt is a string, a list of {'role', 'content'} messages, or a list of token ids")
    bad = outside_vocabulary(ids, target.cfg.vocab_size)
    if bad is not None:
        raise PromptError(f"prompt token id {bad} is outside the vocabulary [0, {target.cfg.vocab_size})")
    return ids


@dataclass(frozen=True)
class SpeculativeModel:
    """A loaded target and how it decodes; any number of generations, one at a time (each gets its own
    caches and drafter state, so a generation leaves nothing behind for the next)."""

    target: LoadedModel
    strategy: Strategy

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def with_decoding(self, drafter: DrafterChoice = SHIPPED, **decoding: Any) -> SpeculativeModel:
        """The same loaded target with other decoding settings (those of :func:`decoding_strategy`)."""
        return replace(self, strategy=decoding_strategy(self.target, drafter, **decoding))

    def generate(self, prompt: Prompt, *, system: str | None = None, raw: bool = False, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None,
                 stop: str | Sequence[str] = (), logprobs: int | None = None, on_text: TextCallback | None = None,
                 on_piece: PieceCallback | None = None,
                 on_prefill: ChunkCallback | None = None,
                 prompt_cache: PromptCache | None = None) -> GenerationResult:
        """One assistant turn for ``prompt`` (see :func:`encode_prompt`).

        Greedy at ``temperature`` 0: the text is exactly what the target alone would write. Sampling keeps
        the target's distribution; ``seed`` repeats a sample. ``presence_penalty`` and ``frequency_penalty``
        and ``logit_bias`` (token id → added to its logit) are OpenAI's (greedy then follows the adjusted target
        exactly). ``logprobs`` (0-20) fills the result's ``logprobs``:
        each token's log-probability under the target and that many most likely tokens at its position (the
        target's own distribution, before penalties, bias, temperature and top-k/top-p). ``on_text`` receives the text as it is
        decoded, ``on_piece`` the same with whether it came from accepted drafts; ``on_prefill`` gets
        (prompt tokens read, prompt tokens) as a long prompt is read, chunk by chunk, and may raise to
        abandon the generation there. With a ``prompt_cache`` (``moaspec.PromptCache(max_bytes)``, yours to keep
        between calls) a prompt that begins with one read before, or with one and its answer, as a
        conversation's next turn does, is read only from where they part, and the drafter begins from its
        state of that beginning.
        """
        ids = encode_prompt(self.target, prompt, system, raw)
        config = GenerationConfig(max_new_tokens=max_new_tokens,
                                  sampling=SamplingParams(temperature, top_k, top_p, seed, presence_penalty,
                                                          frequency_penalty, tuple((logit_bias or {}).items())),
                                  stop=(stop,) if isinstance(stop, str) else stop, logprobs=logprobs)
        return self.strategy.run(self.target, ids, config, on_text=on_text, on_piece=on_piece, prefill=Prefill(on_prefill, prompt_cache))

    def __repr__(self) -> str:
        return f"SpeculativeModel(target={self.target.path.name!r}, decoding={self.strategy.describe()!r})"


def load(model: str | os.PathLike[str] | None = None, drafter: DrafterChoice = SHIPPED, *,
         device: str | None = None, dtype: torch.dtype | str | None = None, threads: int | None = None,
         **decoding: Any) -> SpeculativeModel:
    """Load a target (the default model, a ``.gguf`` file or a local Hugging Face directory) and its drafter.

    ``threads`` sets torch's CPU threads for the whole process, before loading, since the runtime picks
    its kernels by timing them at load. The target runs in fp32 unless ``dtype`` says otherwise (half
    precision is not lossless: see the README). ``decoding``: the settings of :func:`decoding_strategy`.
    """
    import torch

    from moaspec.heap import cap_kernel_caches
    from moaspec.models import load_model

    if threads is not None:
        if not (whole_number(threads) and threads >= 1):
            raise MoaspecError(f"threads must be a whole number >= 1, got {threads!r}")
        torch.set_num_threads(threads)
    cap_kernel_caches()
    target = load_model(None if model is None else os.fspath(model), device=device, dtype=dtype)
    return SpeculativeModel(target, decoding_strategy(target, drafter, **decoding))
