"""The decoding methods a benchmark compares, each behind one call: prompt ids → a generation.

moaspec's own decoders (vanilla, MoA and EAGLE-2 drafters with chains or trees) run
on this project's runtime; transformers' ``generate`` and its built-in accelerators
run unmodified on the same weights as external peers, with a forward hook counting
their target calls. All of them decode greedily, or all sample with the same
temperature, top-k and top-p (transformers applies them in the same order).
"""

from __future__ import annotations

import time
import zlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import torch

from moaspec.costs import policy_for
from moaspec.decoding import GenerationConfig
from moaspec.decoding.detokenize import Detokenizer
from moaspec.decoding.generation import GenerationResult
from moaspec.decoding.lookup import DEFAULT_LOOKUP
from moaspec.decoding.opening import stop_token_ids
from moaspec.decoding.policy import MAX_CHAIN, MAX_NEW
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.speculative import DEFAULT_CHAIN, DEFAULT_CONFIDENCE
from moaspec.decoding.tree import TreeShape
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.drafters.base import Drafter
from moaspec.drafters.checkpoint import KINDS
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.independent import IndependentDrafter, to_hf_llama
from moaspec.drafters.moa import MoADrafter
from moaspec.errors import MoaspecError
from moaspec.models.loading import LoadedModel
from moaspec.strategy import Strategy

Method = Callable[[Sequence[int], int], GenerationResult]
KNOWN = ("vanilla", "default", "moa", "moa-cost", "moa-chain", "moa-pld", "moa-chain-pld", "pld", "eagle2", "independent", "hf", "hf-pld", "hf-assisted")


@dataclass(frozen=True)
class MethodOptions:
    moa_drafter: str | None = None  # default: the shipped one
    eagle_drafter: str | None = None
    independent_drafter: str | None = None
    tree: TreeShape = TreeShape()
    chain: int = DEFAULT_CHAIN
    confidence: float = DEFAULT_CONFIDENCE  # chains (moa-chain, moa-chain-pld, independent) end below it
    pld_tokens: int = DEFAULT_LOOKUP  # prompt lookup drafts per target forward (pld, moa-pld, moa-chain-pld, hf-pld)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # greedy unless temperature > 0


def prompt_seed(seed: int | None, prompt: Sequence[int]) -> int:
    """A sampling seed for one prompt, derived from the run's seed and the prompt's ids.

    Every method answering a prompt starts from the same seed, and a rerun repeats each
    answer, while different prompts (and later turns) still draw different numbers.
    """
    return zlib.crc32(array("q", list(prompt)).tobytes(), (seed or 0) & 0xFFFFFFFF)


def for_prompt(sampling: SamplingParams, prompt: Sequence[int]) -> SamplingParams:
    """``sampling`` seeded for one prompt (:func:`prompt_seed`); greedy settings need no seed and stay as they are."""
    return sampling if sampling.greedy else replace(sampling, seed=prompt_seed(sampling.seed, prompt))


def strategy_method(target: LoadedModel, strategy: Strategy, sampling: SamplingParams) -> Method:
    """A benchmark method decoding with ``strategy`` (sampling seeded per prompt, see :func:`for_prompt`)."""
    def method(prompt: Sequence[int], max_new: int) -> GenerationResult:
        return strategy.run(target, prompt, GenerationConfig(max_new_tokens=max_new, sampling=for_prompt(sampling, prompt)))
    return method


def _hf(target: LoadedModel, hf: object, sampling: SamplingParams, **kwargs: object) -> Method:
    """transformers ``generate``, greedy or sampling as ``sampling`` says, its target forwards counted by a hook."""
    calls = [0]
    hf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))  # type: ignore[attr-defined]
    eos = stop_token_ids(target.model, target.tokenizer)
    if sampling.greedy:
        kwargs["do_sample"] = False
    else:  # top_k=0 switches off transformers' default of 50, as it is off here
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)

    def method(prompt: Sequence[int], max_new: int) -> GenerationResult:
        calls[0] = 0
        if not sampling.greedy:
            torch.manual_seed(prompt_seed(sampling.seed, prompt))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new,  # type: ignore[attr-defined]
                              **kwargs)[0, len(prompt):].tolist()
        total = time.perf_counter() - t0
        finish = "length"
        for i, t in enumerate(out):
            if t in eos:
                out, finish = out[:i], "eos"
                break
        detok = Detokenizer(target.tokenizer)  # the same text rule as moaspec's decoders
        detok.push(out)
        detok.flush()
        text = detok.text
        return GenerationResult(token_ids=out, text=text, finish_reason=finish, prompt_tokens=len(prompt),
                                prefill_s=0.0, total_s=total, target_calls=max(0, calls[0] - 1))
    return method


_WHERE = {
    MoADrafter: "--drafter",
    EagleDrafter: "--eagle-drafter (train one with `moaspec train --kind eagle`)",
    IndependentDrafter: "--independent-drafter (train one with `moaspec train --kind independent`)",
}


D = TypeVar("D", bound=Drafter)


def require_drafter(path: str | Path | None, kind: type[D], used_by: str, target: LoadedModel) -> D:
    """The drafter at ``path`` (else the one of that kind shipped for ``target``), which the method(s) ``used_by``
    need to be a ``kind``; a clear error otherwise."""
    if path is None:
        path = shipped_drafter(target, next(name for name, (_, cls) in KINDS.items() if cls is kind))
    if path is None:
        raise MoaspecError(f"{used_by} needs {_WHERE[kind]}")
    drafter = load_drafter(path, target)
    if not isinstance(drafter, kind):
        raise MoaspecError(f"{path} is not a drafter of the kind {used_by} needs ({kind.__name__})")
    return drafter


def build_methods(names: Sequence[str], target: LoadedModel, opts: MethodOptions) -> dict[str, Method]:
    """The methods by name; drafters load once each, and one transformers model serves every hf method.

    ``independent`` drafts chains (classic speculative decoding) of ``opts.chain``;
    ``hf-assisted`` hands the same independent drafter, converted to a transformers
    ``LlamaForCausalLM``, to ``generate`` as its ``assistant_model``. ``pld`` is prompt
    lookup on this runtime (``hf-pld`` is transformers' own); ``moa-pld`` grafts it onto
    MoA's trees, ``moa-chain-pld`` puts it in front of MoA's chains. ``default`` is what ``moaspec generate``
    does without options: lookup and MoA's chains decided cycle by cycle by cost (:mod:`moaspec.decoding.policy`),
    with this host's measured costs. ``moa-cost`` is ``moa``'s trees under the same policy: a plain step wherever
    the tree is not expected to pay, so that the tree is judged as the default's chains are.
    """
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise MoaspecError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(KNOWN)}")
    methods: dict[str, Method] = {}
    moa = None
    if {"moa", "moa-cost", "moa-chain", "moa-pld", "moa-chain-pld", "default"} & set(names):
        path = opts.moa_drafter or shipped_drafter(target)
        if path is None:
            raise MoaspecError(f"no MoA drafter for {target.path.name}: pass --drafter")
        moa = require_drafter(str(path), MoADrafter, "moa", target)
    independent = None
    if {"independent", "hf-assisted"} & set(names):
        independent = require_drafter(opts.independent_drafter, IndependentDrafter, "independent / hf-assisted", target)
    hf = None

    def ours(strategy: Strategy) -> Method:
        return strategy_method(target, strategy, opts.sampling)

    for name in names:
        if name == "vanilla":
            methods[name] = ours(Strategy())
        elif name == "default":
            methods[name] = ours(Strategy(moa, chain=MAX_CHAIN, lookup=MAX_NEW - 1, policy=policy_for(target, path, moa)))
        elif name == "moa":
            methods[name] = ours(Strategy(moa, tree=opts.tree))
        elif name == "moa-cost":
            methods[name] = ours(Strategy(moa, tree=opts.tree, policy=policy_for(target, path, moa)))
        elif name == "moa-chain":
            methods[name] = ours(Strategy(moa, chain=opts.chain, confidence=opts.confidence))
        elif name == "moa-pld":
            methods[name] = ours(Strategy(moa, tree=opts.tree, lookup=opts.pld_tokens))
        elif name == "moa-chain-pld":
            methods[name] = ours(Strategy(moa, chain=opts.chain, lookup=opts.pld_tokens, confidence=opts.confidence))
        elif name == "pld":
            methods[name] = ours(Strategy(lookup=opts.pld_tokens))
        elif name == "eagle2":
            methods[name] = ours(Strategy(require_drafter(opts.eagle_drafter, EagleDrafter, name, target), tree=opts.tree))
        elif name == "independent":
            methods[name] = ours(Strategy(independent, chain=opts.chain, confidence=opts.confidence))
        else:
            if hf is None:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32).eval()
            if name == "hf":
                methods[name] = _hf(target, hf, opts.sampling)
            elif name == "hf-pld":
                methods[name] = _hf(target, hf, opts.sampling, prompt_lookup_num_tokens=opts.pld_tokens)
            else:
                assert isinstance(independent, IndependentDrafter)
                methods[name] = _hf(target, hf, opts.sampling, assistant_model=to_hf_llama(independent))
    return methods
