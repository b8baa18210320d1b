"""The ``moaspec`` command.

Every user mistake ends as one line on stderr and exit code 2; an interrupted run
exits 130. Tracebacks are reserved for bugs.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from moaspec.errors import MoaspecError

EXIT_USAGE = 2
# what the machine, not moaspec, refused, and what to do; every file is written atomically, so what was
# being written is simply absent
DISK_ERRORS = {
    errno.ENOSPC: "free some space and run the command again (data, train, bench, bench-cs and tune resume where they stopped)",
    errno.EDQUOT: "the disk quota is used up; free some space and run the command again",
    errno.EACCES: "check its permissions, or choose another place",
    errno.EROFS: "the file system is read-only; choose another place",
}
DRAFT_COLOUR, UNVERIFIED_COLOUR, RESET = "\033[36m", "\033[33m", "\033[0m"


def _require(args: argparse.Namespace, rule: str, holds: Callable[[Any], bool], *names: str) -> None:
    """Refuse the first option of ``names`` whose value (when given) breaks ``rule``, naming it and its value."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not holds(value):
            raise MoaspecError(f"--{name.replace('_', '-')} must be {rule}, got {value}")


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low  # False for NaN


def _finite_positive(v: float) -> bool:
    return math.isfinite(v) and v > 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return n


def _lsa_width(text: str) -> int | str:
    """``--lsa-width``: a whole number (checked against LSA's 64-wide heads later) or "full"."""
    if text == "full":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor 'full'") from None


def _add_model_options(p: argparse.ArgumentParser, threads: str = "torch's choice") -> None:
    from moaspec.drafters.checkpoint import DTYPE_CHOICES

    p.add_argument("--model", default=None, help="model: 'smollm2' (default, embedded), a .gguf file, or a local HF model directory")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=_positive_int, default=None, help=f"CPU threads for torch (default: {threads})")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="the target's weights and activations (default: float32 on every device, where greedy "
                        "speculative output equals vanilla's token for token; bfloat16/float16 are faster on GPUs but "
                        "round a verification differently from one-token steps, so answers can part at near-ties)")


def _add_drafter_dtype_option(p: argparse.ArgumentParser) -> None:
    from moaspec.drafters.checkpoint import DTYPE_CHOICES

    p.add_argument("--drafter-dtype", choices=DTYPE_CHOICES, default=None,
                   help="the drafters' weights and activations (default 'auto': bf16 on CPUs with oneDNN bf16 kernels, "
                        "else the target's dtype); never changes the text, only which drafts are accepted")


def _add_sampling_options(p: argparse.ArgumentParser, seed_help: str = "seed for sampling") -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help=seed_help)


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many new tokens (default 256)")
    _add_sampling_options(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _default_chain() -> int:
    from moaspec.decoding.speculative import DEFAULT_CHAIN

    return DEFAULT_CHAIN


def _default_lookup() -> int:
    from moaspec.decoding.lookup import DEFAULT_LOOKUP

    return DEFAULT_LOOKUP


def _probability(text: str) -> float:
    try:
        p = float(text)
    except ValueError:
        p = -1.0
    if not 0 <= p < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability in [0, 1)")
    return p


def _add_confidence_option(p: argparse.ArgumentParser, tunable: bool = False) -> None:
    """``tunable``: left out, the option is None, so that the settings `moaspec tune` saved may apply."""
    from moaspec.decoding.speculative import DEFAULT_CONFIDENCE

    p.add_argument("--draft-confidence", type=_probability, default=None if tunable else DEFAULT_CONFIDENCE, metavar="P",
                   help="end a chain early (chains only): drafts after the first only while the drafter gives them probability "
                        f">= P, so --chain is the most per forward (0: off; default {DEFAULT_CONFIDENCE:g})")


def _add_lookup_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="prompt lookup: up to N drafts copied from where the newest tokens occurred before, before the "
                        "drafter's chain (which drafts only where nothing matches) or grafted onto its tree; "
                        f"0: off (default {_default_lookup()}; with --no-draft 0, and N > 0 runs lookup alone)")


def _add_tree_options(p: argparse.ArgumentParser) -> None:
    from moaspec.decoding.tree import TreeShape

    d = TreeShape()
    p.add_argument("--tree-depth", type=int, default=None, help=f"tree levels below the newest token (default {d.depth})")
    p.add_argument("--tree-top-k", type=int, default=None, help=f"nodes expanded per level and children per node (default {d.top_k})")
    p.add_argument("--tree-total", type=int, default=None, help=f"tree nodes verified per target forward (default {d.total})")


def _tree_knobs(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The tree ``--tree-depth``, ``--tree-top-k`` and ``--tree-total`` describe, the rest from the defaults."""
    from moaspec.decoding.tree import TreeShape

    d = TreeShape()
    return TreeShape(d.depth if args.tree_depth is None else args.tree_depth,
                     d.top_k if args.tree_top_k is None else args.tree_top_k,
                     d.total if args.tree_total is None else args.tree_total)


def _tree_shape(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The tree the options ask for (``--tree`` and its knobs), or None for chains."""
    if args.tree:
        return _tree_knobs(args)
    if any(getattr(args, k) is not None for k in ("tree_depth", "tree_top_k", "tree_total")):
        raise MoaspecError("--tree-depth, --tree-top-k and --tree-total shape a tree: add --tree")
    return None


def _add_decoding_options(p: argparse.ArgumentParser) -> None:
    """How ``generate`` and ``serve`` decode with a drafter; left out, what `moaspec tune` measured fastest here."""
    p.add_argument("--chain", type=int, default=None, metavar="T",
                   help=f"chain drafting: T drafts per target forward (default {_default_chain()}, measured best on the "
                        "CPUs of BENCHMARKS.md, or what `moaspec tune` saved for this machine)")
    _add_confidence_option(p, tunable=True)
    p.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic-tree drafting instead of a chain")
    _add_tree_options(p)
    _add_lookup_option(p)
    p.add_argument("--no-tuned", action="store_true",
                   help="ignore the settings `moaspec tune` saved for this machine (used when no decoding option is given)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moaspec", description="Mixture of Attentions speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="answer a chat prompt, streaming the text")
    g.add_argument("prompt", nargs="?", default=None, help="the user message ('-' reads it from stdin)")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--messages", default=None, help="JSON file with a list of {role, content} messages (multi-turn)")
    g.add_argument("--raw", action="store_true", help="plain completion of the prompt text, no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token counts, tau, timings) instead of streaming")
    g.add_argument("--chat", action="store_true",
                   help="a conversation: after each answer, read the next message from stdin (/reset starts over, "
                        "/exit or end of input ends it); each turn reads only what is new of the conversation")
    g.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the one shipped for the target)")
    g.add_argument("--no-draft", action="store_true", help="plain decoding, one target forward per token")
    _add_decoding_options(g)
    g.add_argument("--show-drafts", action="store_true", help="colour the text that came from accepted drafts")
    _add_model_options(g)
    _add_drafter_dtype_option(g)
    _add_generation_options(g)

    u = sub.add_parser("tune", help="measure the fastest chain/tree/lookup setting on this machine and save it as the "
                                    "default of generate, serve and moaspec.load")
    u.add_argument("--drafter", default=None, help="the drafter to tune for (default: the one shipped for the target)")
    u.add_argument("--questions", default=None,
                   help="SpecBench-format .jsonl file or directory to time on (default: 12 built-in prompts of six kinds)")
    u.add_argument("--limit", type=int, default=None, help="the first K questions of each file")
    u.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    u.add_argument("--output", default=None,
                   help="run directory for answers, summary.json and plots (default: beside the saved setting, in the "
                        "cache); an interrupted run resumes there")
    u.add_argument("--no-save", action="store_true", help="measure and print, but save nothing")
    u.add_argument("--no-progress", action="store_true")
    _add_model_options(u)
    _add_drafter_dtype_option(u)

    b = sub.add_parser("bench", help="compare decoding methods on SpecBench-format questions (tokens/s, speedup, tau, mismatches)")
    b.add_argument("--questions", required=True, help="a SpecBench-format .jsonl file or a directory of them")
    b.add_argument("--methods", default="vanilla,moa,hf",
                   help="comma list from vanilla, moa, moa-chain, moa-pld, moa-chain-pld, pld, eagle2, independent, hf, hf-pld, hf-assisted")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--limit", type=int, default=None, help="the first K questions of each file")
    b.add_argument("--output", required=True, help="directory for answers.jsonl, summary.json and plots")
    b.add_argument("--drafter", default=None, help="MoA drafter (default: the shipped one)")
    b.add_argument("--eagle-drafter", default=None, help="EAGLE drafter for eagle2 (default: the one shipped for the target)")
    b.add_argument("--independent-drafter", default=None, help="independent drafter for independent and hf-assisted")
    b.add_argument("--chain", type=int, default=_default_chain(), help="drafts per target forward for moa-chain, moa-chain-pld and independent")
    _add_confidence_option(b)
    b.add_argument("--lookup", type=int, default=_default_lookup(),
                   help="prompt lookup drafts per target forward for pld, moa-pld, moa-chain-pld and hf-pld")
    _add_tree_options(b)
    _add_sampling_options(b, "seed for sampling (default 0); each prompt gets its own seed derived from it and the "
                             "prompt, the same for every method, so a run repeats exactly")
    b.add_argument("--no-progress", action="store_true")
    _add_model_options(b)
    _add_drafter_dtype_option(b)

    d = sub.add_parser("data", help="make a distillation set: answers written by the target itself, to prompts it "
                                    "writes (Magpie) or to yours (--prompts)")
    d.add_argument("--output", required=True, help="directory for shards and manifest.json (resumes if it exists)")
    d.add_argument("--examples", type=int, default=2000,
                   help="stop once at least this many assistant turns are written (shards are written whole, so the "
                        "last one may go past it)")
    d.add_argument("--shard-size", type=int, default=64, help="conversations started per shard")
    d.add_argument("--batch-size", type=int, default=32, help="sequences decoded together")
    d.add_argument("--max-query-tokens", type=int, default=96, help="budget of a written user prompt")
    d.add_argument("--max-passage-tokens", type=int, default=512,
                   help="longest text a summarisation or passage-question prompt pastes")
    d.add_argument("--max-answer-tokens", type=int, default=384)
    d.add_argument("--multi-turn", type=float, default=0.2, help="fraction of conversations with a second user turn")
    d.add_argument("--greedy-fraction", type=float, default=0.5, help="fraction of answers decoded greedily (rest sampled)")
    d.add_argument("--prompts", metavar="FILE",
                   help="your own conversations (JSON lines or a JSON array: ShareGPT, chat messages, "
                        '{"turns": [...]}, {"prompt": ...}, Alpaca, or strings): the target answers each user turn '
                        "instead of prompts it writes; the run ends when the file is used up")
    d.add_argument("--passages", metavar="PATH",
                   help="a text file, or a directory of .txt/.md/.rst files, whose paragraphs are pasted under the "
                        "summarisation and passage-question instructions instead of the target's own answers")
    d.add_argument("--pasted-fraction", type=float,
                   help="share of conversations that paste a text (default 2 of 7; 0 with --prompts gives your "
                        "prompts alone)")
    d.add_argument("--part", metavar="K/N",
                   help="take every N-th conversation of --prompts and passage of --passages, from the K-th on, so "
                        "that N data processes (each with its own --output and --seed) share the files")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress", action="store_true")
    _add_model_options(d)

    t = sub.add_parser("train", help="distil a MoA drafter from the target (HF Accelerate; works under accelerate launch / torchrun)")
    t.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="one or more directories made by `moaspec data`, trained on together")
    t.add_argument("--output", required=True, help="run directory: state, logs, and the exported drafter in OUTPUT/drafter (resumes if it exists)")
    t.add_argument("--kind", choices=("moa", "eagle", "independent"), default="moa",
                   help="drafter to train: MoA, the EAGLE baseline, or an independent small model (classic speculative decoding)")
    t.add_argument("--steps", type=int, default=1000, help="optimizer updates")
    t.add_argument("--tokens-per-batch", type=int, default=4096, help="tokens per micro-batch and process, padding included")
    t.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update")
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--warmup", type=int, default=50, help="linear warm-up updates, then cosine decay")
    t.add_argument("--max-len", type=int, default=1024, help="truncate sequences to this many tokens")
    t.add_argument("--draft-vocab", type=int, default=8192, help="draft logits over the K most frequent target outputs (0 = whole vocabulary)")
    t.add_argument("--tli-layers", type=int, default=0, help="Target Layer Inference: reuse the target's last N layers")
    t.add_argument("--segment-min", type=int, default=5, help="shortest T-step-bounded training segment")
    t.add_argument("--segment-max", type=int, default=15, help="longest T-step-bounded training segment")
    t.add_argument("--segment-long-fraction", type=float, default=0.0,
                   help="share of segments drawn longer, from segment-max+1 to --segment-long-max (drafting alone)")
    t.add_argument("--segment-long-max", type=int, default=0, help="longest of those long segments")
    t.add_argument("--no-staircase", action="store_true", help="no SA curriculum")
    t.add_argument("--kl-weight", type=float, default=None,
                   help="weight of the KL term of the loss (default 0.1, the paper's)")
    t.add_argument("--feature-weight", type=float, default=None,
                   help="weight of the SmoothL1 feature term (default 1.0, the paper's)")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--val-fraction", type=float, default=0.02)
    t.add_argument("--mixed-precision", choices=("auto", "no", "fp16", "bf16"), default="auto")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--sa-mlp", type=int, default=None, help="SA MLP width (default: the target's)")
    t.add_argument("--ca-mlp", type=int, default=None, help="CA MLP width (default: the target's)")
    t.add_argument("--lsa-width", type=_lsa_width, default=None,
                   help="LSA width, a multiple of 64, or 'full': a layer's K/V width, the paper's "
                        "(default: half of that)")
    t.add_argument("--lsa-mlp", type=int, default=None, help="LSA MLP width (default: twice the LSA width)")
    memory = t.add_mutually_exclusive_group()
    memory.add_argument("--no-lsa", action="store_true",
                        help="ablation: MoA's memory from the target's final states instead of Layer Self-Attention over all layers")
    memory.add_argument("--memory-final", action="store_true",
                        help="extension beyond the paper: each memory entry adds a projection of the target's final state "
                             "of its token to LSA's output (with --init-from a plain MoA drafter: added at zero)")
    t.add_argument("--newest-entry", action="store_true",
                   help="extension beyond the paper: Cross-Attention's input also carries a projection of the newest "
                        "memory entry it may read, as EAGLE's first draft reads the newest verified state "
                        "(with --init-from a drafter without it: added at zero)")
    t.add_argument("--derotate-keys", action="store_true",
                   help="extension beyond the paper: Layer Self-Attention reads each layer's keys with their rotary "
                        "position removed (the cache holds them rotated); with --init-from a drafter without it: "
                        "an approximate warm start")
    t.add_argument("--layers", type=int, default=None,
                   help="independent drafter: decoder blocks, copied from the target's first ones (default 2)")
    t.add_argument("--init-from", default="",
                   help="start from this exported drafter (RUN/drafter) instead of random weights; "
                        "a MoA one may change --tli-layers or add --memory-final, --newest-entry or --derotate-keys")
    t.add_argument("--same-data-as", default="", metavar="RUN",
                   help="train on exactly the batches another run used (its shards per epoch and draft vocabulary): "
                        "a like-for-like comparison even after the data set grew")
    t.add_argument("--no-feature-cache", action="store_true",
                   help="recompute the target's features every epoch instead of caching them (fp16, ~24 KiB/token for SmolLM2) under DIR/features")
    t.add_argument("--no-progress", action="store_true")
    _add_model_options(t)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with MoA acceleration and a chat page at /")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $MOASPEC_API_KEY; unset = no authentication)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: from the model file)")
    s.add_argument("--parallel", type=int, default=2, help="requests decoded at once, each on its own thread and caches (default 2)")
    s.add_argument("--max-queue", type=int, default=16, help="requests that may wait for a slot; more get 503 (default 16)")
    s.add_argument("--prompt-cache-mb", type=int, default=512,
                   help="memory for the K/V of recently read prompts (and of ended client–server sessions), so that "
                        "a conversation's next turn reads only its new messages (default 512 MiB; 0: off)")
    s.add_argument("--default-max-tokens", type=int, default=512, help="max_tokens when a request gives none (default 512)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted (default 1 MiB)")
    s.add_argument("--max-sessions", type=int, default=32, help="client–server sessions held at once (default 32)")
    s.add_argument("--max-draft", type=int, default=64, help="most tokens per client–server verification (default 64)")
    s.add_argument("--session-ttl", type=float, default=300.0, help="seconds before an idle client–server session expires")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--drafter", default=None, help="drafter checkpoint directory (default: the one shipped for the target)")
    s.add_argument("--remote-drafter", action="append", default=[], metavar="DIR",
                   help="another MoA drafter whose server half (LSA) serves client–server clients, e.g. one with "
                        "another --tli-layers (repeatable)")
    s.add_argument("--no-draft", action="store_true", help="plain decoding")
    _add_decoding_options(s)
    _add_model_options(s, threads="the cores shared between the --parallel decoders, and all of them to a prompt "
                                  "read while nothing else runs; a number fixes every decoder's")
    _add_drafter_dtype_option(s)

    c = sub.add_parser("client", help="draft here, verify on a `moaspec serve` server (keeps generating if it goes away)")
    c.add_argument("prompt", nargs="?", default=None, help="the user message ('-' reads it from stdin)")
    c.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    c.add_argument("--api-key", default=None, help="bearer token (default: $MOASPEC_API_KEY)")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--chat", action="store_true",
                   help="a conversation, as generate --chat: each turn the server reads only what is new, and a MoA "
                        "client keeps its drafter's state of the conversation, so the server sends only the new tokens'")
    c.add_argument("--drafter", default=None, help="MoA (any N), EAGLE or independent drafter (default: the MoA one shipped for the target)")
    c.add_argument("--chain", type=int, default=_default_chain(), metavar="T",
                   help=f"drafts per verification (default {_default_chain()}, as for generate)")
    _add_confidence_option(c)
    c.add_argument("--lookup", type=int, default=_default_lookup(), metavar="N",
                   help="prompt lookup: send up to N drafts copied from where the newest tokens occurred before, and "
                        f"the drafter's chain only where nothing matches; 0: off (default {_default_lookup()}). "
                        "Offline, the drafter alone writes")
    c.add_argument("--tree", action="store_true", help="send EAGLE-2 dynamic draft trees instead of chains")
    _add_tree_options(c)
    c.add_argument("--state-format", choices=("fp16", "int8"), default="fp16", help="how the server sends each verified token's state (default fp16)")
    c.add_argument("--timeout", type=float, default=10.0,
                   help="seconds before a request counts as lost (default 10; opening a session waits 10 ms more per "
                        "prompt token, for the server to read the prompt)")
    c.add_argument("--retries", type=int, default=2, help="retries of a lost request before going offline (default 2)")
    c.add_argument("--max-new-tokens", type=int, default=256)
    _add_sampling_options(c, "seed for sampling (the server's draws, and the client's while it writes alone)")
    c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    c.add_argument("--bundle", default=None, help="run from a client bundle (`moaspec export-client`) instead of the whole target")
    c.add_argument("--network", default=None, metavar="PROFILE",
                   help="go through an emulated link: lan, 4g, 5g, optionally +offline-after:K (the link dies after "
                        "K tokens), e.g. 4g+offline-after:32")
    c.add_argument("--json", action="store_true", help="print one JSON object (text, tau, server calls, bytes/token)")
    c.add_argument("--show-drafts", action="store_true", help="colour text from accepted drafts")
    _add_model_options(c)
    _add_drafter_dtype_option(c)

    e = sub.add_parser("export-client", help="write what a client device needs: embeddings, drafter, tokenizer, and the last N layers for a TLI drafter (not the whole target)")
    e.add_argument("--output", required=True, help="directory for the bundle (written atomically)")
    e.add_argument("--drafter", default=None, help="MoA (any N), EAGLE or independent drafter (default: the MoA one shipped for the target)")
    _add_model_options(e)

    bc = sub.add_parser("bench-cs", help="client–server decoding under emulated 4G/5G/LAN links, and after a disconnection")
    bc.add_argument("--questions", required=True, help="a SpecBench-format .jsonl file or a directory of them")
    bc.add_argument("--limit", type=int, default=None, help="the first K questions of each file")
    bc.add_argument("--profiles", default="lan,4g,5g", help="comma list from lan, 4g, 5g, none (default lan,4g,5g)")
    bc.add_argument("--methods", default="moa,api",
                    help="comma list from moa, moa-pld (prompt lookup first), moa-tree (dynamic trees), eagle2, independent, api")
    bc.add_argument("--lookup", type=int, default=_default_lookup(), metavar="N",
                    help=f"prompt lookup drafts per verification for moa-pld (default {_default_lookup()})")
    bc.add_argument("--eagle-drafter", default=None, help="EAGLE drafter for eagle2 (`moaspec train --kind eagle`; default: the one shipped for the target)")
    bc.add_argument("--independent-drafter", default=None,
                    help="independent drafter for independent (`moaspec train --kind independent`)")
    bc.add_argument("--output", required=True, help="directory for summary.json")
    bc.add_argument("--max-new-tokens", type=int, default=128)
    bc.add_argument("--drafter", default=None, help="MoA drafter (default: the shipped one)")
    bc.add_argument("--chain", type=int, default=_default_chain(), help=f"drafts per verification (default {_default_chain()})")
    _add_confidence_option(bc)
    _add_tree_options(bc)
    bc.add_argument("--state-format", choices=("fp16", "int8"), default="fp16")
    bc.add_argument("--disconnect-after", type=int, default=32, help="cut the link after K verified tokens (0: no study)")
    bc.add_argument("--disconnect-drafters", default="", metavar="DIR[,DIR]",
                    help="more MoA drafters (one per N, e.g. --tli-layers 1) for the disconnection study")
    bc.add_argument("--continue-tokens", type=int, default=128, help="tokens the client generates alone after the cut")
    bc.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (default); > 0: every method samples (the disconnection study stays greedy)")
    bc.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    bc.add_argument("--seed", type=int, default=None,
                    help="seed for sampling (default 0); each prompt's is derived from it, the same for every method")
    bc.add_argument("--port", type=int, default=8790, help="port for the server this command starts")
    bc.add_argument("--no-progress", action="store_true")
    _add_model_options(bc)
    _add_drafter_dtype_option(bc)

    h = sub.add_parser("export-hf", help="write an independent drafter as a standalone transformers model directory")
    h.add_argument("--drafter", required=True, help="independent drafter (`moaspec train --kind independent`)")
    h.add_argument("--output", required=True, help="directory for config.json, model.safetensors and the tokenizer")
    _add_model_options(h)
    return parser


def _read_stdin() -> str:
    """The prompt from stdin, as UTF-8 whatever the locale (whose own decoding may fail, or keep bad bytes)."""
    from moaspec.errors import PromptError

    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise PromptError("the prompt is not valid UTF-8 text") from None


def _read_messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    if args.messages is None:
        return None
    if args.prompt is not None:
        raise MoaspecError("give either a prompt or --messages, not both")
    if args.system is not None or args.raw:
        raise MoaspecError("--messages carries its own system message and chat template: --system and --raw apply "
                           "to a single prompt")
    try:
        with open(args.messages, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise MoaspecError(f"cannot read {args.messages}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise MoaspecError(f"{args.messages} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise MoaspecError(f"{args.messages} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list):
        raise MoaspecError(f"{args.messages} must hold a JSON list of messages")
    return data


def cmd_generate(args: argparse.Namespace) -> int:
    from moaspec.api import encode_prompt
    from moaspec.chat import encode_chat
    from moaspec.decoding import GenerationConfig, SamplingParams
    from moaspec.decoding.prefill import Prefill
    from moaspec.errors import PromptError

    messages = _read_messages(args)
    prompt = args.prompt
    if args.chat and (args.json or args.raw):
        raise MoaspecError("--chat streams a conversation in the chat template: not with --json or --raw")
    if messages is None and not (args.chat and prompt is None):
        if prompt == "-":
            prompt = _read_stdin()
        if prompt is None or not prompt.strip():
            raise PromptError("the prompt is empty")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
        stop=tuple(args.stop),
    )
    loaded = _load(args)
    if args.chat:  # a prompt cache keeps what each turn read and wrote: the next reads only the new message
        from moaspec.decoding.prefill import PromptCache

        strategy, reuse = _strategy(args, loaded), PromptCache(CHAT_CACHE_BYTES)

        def answer(ids: list[int], write: Writer) -> None:
            strategy.run(loaded, ids, config, on_piece=lambda text, drafted: write(text, DRAFT_COLOUR if drafted and
                         args.show_drafts else ""), prefill=Prefill(_prefill_bar(len(ids)), reuse))

        return _chat(loaded.tokenizer, answer, _chat_start(args, messages, prompt))
    ids = encode_chat(loaded.tokenizer, messages) if messages is not None else encode_prompt(loaded, prompt, args.system,
                                                                                              args.raw)

    def coloured(text: str, drafted: bool) -> None:
        _show(text, DRAFT_COLOUR if drafted else "")

    strategy = _strategy(args, loaded)
    if args.show_drafts and not args.json and (strategy.drafter is not None or strategy.lookup):
        print(f"({DRAFT_COLOUR}accepted drafts{RESET}, target tokens plain)", file=sys.stderr)
    result = strategy.run(loaded, ids, config, on_text=None if args.json else _show,
                          on_piece=coloured if args.show_drafts and not args.json else None,
                          prefill=Prefill(None if args.json else _prefill_bar(len(ids))))
    if args.json:
        print(json.dumps({**result.to_dict(), "decoding": strategy.describe(), "tuned_from": strategy.tuned_from},
                         ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if result.finish_reason == "length" and result.new_tokens < config.max_new_tokens:
            print(f"[moaspec: stopped after {result.new_tokens} tokens: the model's context window "
                  f"({loaded.cfg.max_position_embeddings} tokens) is full]", file=sys.stderr)
    return 0


def _show(text: str, colour: str = "") -> None:
    """Stream ``text`` to the terminal now, in ``colour`` (an ANSI code; "" for plain)."""
    sys.stdout.write(f"{colour}{text}{RESET}" if colour else text)
    sys.stdout.flush()


CHAT_CACHE_BYTES = 512 << 20  # the conversation's K/V: 46 KB a token for SmolLM2, so about 11,000 tokens


Writer = Callable[[str, str], None]  # (text, its colour) → the terminal, and the conversation


def _chat(tokenizer: Any, answer: Callable[[list[int], Writer], None], start: list[dict[str, str]]) -> int:
    """``--chat``: answer, then read the next message from stdin, until /exit or the end of input.

    Each turn's prompt is the whole conversation so far (``start`` then the turns); ``answer``
    streams the reply to it through its writer. Ctrl-C stops an answer (what it wrote stays in
    the conversation) or, at the prompt, ends the chat; a message the model's context no longer
    holds is refused and the chat goes on.
    """
    from moaspec.chat import encode_chat
    from moaspec.errors import PromptError

    history = list(start)
    tty = sys.stdin.isatty()
    if tty:
        import readline  # noqa: F401  (line editing and history for input())

        print("(a conversation: /reset starts over, /exit or Ctrl-D ends it, Ctrl-C stops an answer)", file=sys.stderr)
    while True:
        if not history or history[-1]["role"] != "user":
            try:
                line = input("> " if tty else "").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                history = [m for m in start if m["role"] == "system"]
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
        written: list[str] = []

        def write(text: str, colour: str, written: list[str] = written) -> None:
            written.append(text)
            _show(text, colour)

        try:
            answer(encode_chat(tokenizer, history), write)
        except KeyboardInterrupt:
            print(" [stopped]", end="", file=sys.stderr)
        except MoaspecError as exc:  # the conversation outgrew the context window, or no server answers
            history.pop()
            hint = "; /reset starts a new conversation" if isinstance(exc, PromptError) else ""
            print(f"[moaspec: {exc}{hint}]", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(written)})


def _chat_start(args: argparse.Namespace, messages: list[dict[str, str]] | None, prompt: str | None) -> list[dict[str, str]]:
    """The conversation ``--chat`` begins with: ``--messages``, or the prompt (with ``--system``), or nothing."""
    from moaspec.chat import chat_messages, validate_messages

    if messages is not None:
        return validate_messages(messages)
    if prompt:
        return chat_messages(prompt, args.system)
    return [{"role": "system", "content": args.system}] if args.system else []


PREFILL_BAR_TOKENS = 2048  # prompts this long take seconds to read on a CPU (7,800 tokens: 23 s, 2 cores)


def _prefill_bar(prompt_tokens: int) -> Callable[[int, int], None] | None:
    """A progress bar on a terminal while a long prompt is read, so the wait before the answer is not silent; it
    disappears when the answer starts."""
    if prompt_tokens < PREFILL_BAR_TOKENS or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(total=prompt_tokens, desc="reading the prompt", unit="tok", leave=False, file=sys.stderr, mininterval=0)

    def update(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def _strategy(args: argparse.Namespace, loaded):  # type: ignore[no-untyped-def]
    """The decoding the options ask for: the given or shipped drafter, chain or tree, prompt lookup; or none."""
    from moaspec.api import SHIPPED, decoding_strategy

    if args.lookup is not None and args.lookup < 0:
        raise MoaspecError("--lookup must be >= 0 (0: off)")
    if args.chain is not None and args.chain < 1:
        raise MoaspecError("--chain must be >= 1")

    def notify(message: str) -> None:
        print(f"moaspec: {message} (train one with `moaspec train`, then pass --drafter)", file=sys.stderr)

    return decoding_strategy(loaded, None if args.no_draft else args.drafter or SHIPPED, chain=args.chain,
                             tree=_tree_shape(args), lookup=args.lookup, confidence=args.draft_confidence,
                             tuned=not args.no_tuned, notify=notify)


def cmd_data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.fileio import check_output_dir
    from moaspec.training.datagen import MIN_PASSAGE_TOKENS, OUTPUT_FILES, OUTPUT_MARKER, DataConfig, generate_dataset
    from moaspec.training.user_text import load_user_text, parse_part

    check_output_dir(args.output, OUTPUT_MARKER, OUTPUT_FILES)

    _require(args, ">= 1", _at_least(1), "examples", "shard_size", "batch_size", "max_query_tokens",
             "max_passage_tokens", "max_answer_tokens")
    _require(args, "between 0 and 1", lambda v: 0 <= v <= 1, "multi_turn", "greedy_fraction", "pasted_fraction")
    part = None if args.part is None else parse_part(args.part)
    user = load_user_text(args.prompts, args.passages, args.max_passage_tokens, MIN_PASSAGE_TOKENS, part)
    cfg = DataConfig(
        examples=args.examples, shard_size=args.shard_size, batch_size=args.batch_size,
        max_query_tokens=args.max_query_tokens, max_passage_tokens=args.max_passage_tokens,
        max_answer_tokens=args.max_answer_tokens,
        multi_turn=args.multi_turn, greedy_fraction=args.greedy_fraction, seed=args.seed,
        pasted_fraction=args.pasted_fraction,
    )
    loaded = _load(args)
    manifest = generate_dataset(loaded, Path(args.output), cfg, progress=not args.no_progress, user=user)
    records = sum(s["records"] for s in manifest["shards"])
    tokens = sum(s["answer_tokens"] for s in manifest["shards"])
    print(f"{args.output}: {records} assistant turns, {tokens} answer tokens in {len(manifest['shards'])} shards")
    if user.prompts and records < args.examples:
        print(f"(all {len(user.prompts)} conversations of {args.prompts} were used)")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.fileio import check_output_dir
    from moaspec.training.trainer import RUN_FILES, RUN_MARKER, TrainConfig, Trainer

    check_output_dir(args.output, RUN_MARKER, RUN_FILES)

    _require(args, ">= 1", _at_least(1), "steps", "tokens_per_batch", "grad_accum", "max_len", "eval_every",
             "save_every", "segment_min")
    _require(args, "a finite number > 0", _finite_positive, "lr")
    _require(args, ">= 0", _at_least(0), "warmup", "draft_vocab")
    _require(args, "in (0, 1)", lambda v: 0 < v < 1, "val_fraction")
    if args.segment_max < args.segment_min:
        raise MoaspecError("--segment-max must be >= --segment-min")
    _require(args, "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0, "kl_weight", "feature_weight")
    weights = {k: v for k in ("kl_weight", "feature_weight") if (v := getattr(args, k)) is not None}
    if not 0 <= args.segment_long_fraction < 1 or (args.segment_long_fraction > 0 and args.segment_long_max <= args.segment_max):
        raise MoaspecError("--segment-long-fraction must be in [0, 1), and with it --segment-long-max > --segment-max")
    cfg = TrainConfig(
        kind=args.kind, steps=args.steps, tokens_per_batch=args.tokens_per_batch, grad_accum=args.grad_accum, lr=args.lr,
        warmup=args.warmup, max_len=args.max_len, segment_min=args.segment_min, segment_max=args.segment_max,
        segment_long_max=args.segment_long_max, segment_long_fraction=args.segment_long_fraction,
        staircase=not args.no_staircase, val_fraction=args.val_fraction, eval_every=args.eval_every,
        save_every=args.save_every, draft_vocab=args.draft_vocab, tli_layers=args.tli_layers, seed=args.seed,
        mixed_precision=args.mixed_precision, cache_features=not args.no_feature_cache, init_from=args.init_from,
        same_data_as=args.same_data_as, **weights,
    )
    if cfg.kl_weight == cfg.feature_weight == 0:
        raise MoaspecError("--kl-weight and --feature-weight cannot both be 0: nothing would be learnt")
    loaded = _load(args)
    if not 0 <= args.tli_layers < loaded.cfg.num_layers:
        raise MoaspecError(f"--tli-layers must be in 0..{loaded.cfg.num_layers - 1}")
    moa_sizes = (args.sa_mlp, args.ca_mlp, args.lsa_width, args.lsa_mlp)
    if args.kind != "moa" and (args.tli_layers or any(w is not None for w in moa_sizes) or args.no_lsa or args.memory_final
                               or args.newest_entry or args.derotate_keys):
        raise MoaspecError("--tli-layers, --sa-mlp, --ca-mlp, --lsa-width, --lsa-mlp, --no-lsa, --memory-final, "
                           "--newest-entry and --derotate-keys apply to MoA drafters only")
    if args.no_lsa and args.derotate_keys:
        raise MoaspecError("--derotate-keys changes Layer Self-Attention's input, which --no-lsa removes")
    if isinstance(args.lsa_width, int) and (args.lsa_width <= 0 or args.lsa_width % 64):
        raise MoaspecError(f"--lsa-width must be a positive multiple of 64 (LSA's heads are 64 wide), got {args.lsa_width}")
    if args.layers is not None and (args.kind != "independent" or not 1 <= args.layers < loaded.cfg.num_layers):
        raise MoaspecError(f"--layers applies to independent drafters and must be in 1..{loaded.cfg.num_layers - 1}")
    if args.draft_vocab > loaded.cfg.vocab_size:
        raise MoaspecError(f"--draft-vocab must be at most the target's vocabulary ({loaded.cfg.vocab_size}), "
                           f"or 0 for all of it; got {args.draft_vocab}")
    sizes: dict[str, int | str | bool | None] = {}
    if args.kind == "moa":
        sizes = {"sa_mlp": args.sa_mlp, "ca_mlp": args.ca_mlp, "lsa_width": args.lsa_width, "lsa_mlp": args.lsa_mlp,
                 "memory_source": "last-layer" if args.no_lsa else "lsa+final" if args.memory_final else None,
                 "newest_entry": True if args.newest_entry else None,
                 "derotate_keys": True if args.derotate_keys else None}
    elif args.kind == "independent":
        sizes = {"layers": args.layers}
    trainer = Trainer(loaded, [Path(d) for d in args.data], Path(args.output), cfg, sizes, progress=not args.no_progress)
    summary = trainer.train()
    if trainer.acc.is_main_process:
        print(json.dumps({k: summary[k] for k in ("steps", "tokens", "wall_s", "last_val")}))
        print(f"drafter written to {Path(args.output) / 'drafter'}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.bench.methods import MethodOptions, build_methods
    from moaspec.bench.run import run_bench, table
    from moaspec.decoding import SamplingParams
    from moaspec.specbench import check_first_turns_fit, load_questions

    names = _method_list(args.methods)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, 0 if args.seed is None else args.seed)
    _require(args, ">= 1", _at_least(1), "max_new_tokens", "limit", "chain", "lookup")
    questions = load_questions(args.questions, per_file=args.limit)
    loaded = _load(args)
    check_first_turns_fit(questions, loaded.tokenizer, loaded.cfg.max_position_embeddings)
    opts = MethodOptions(moa_drafter=args.drafter, eagle_drafter=args.eagle_drafter,
                         independent_drafter=args.independent_drafter, chain=args.chain, confidence=args.draft_confidence,
                         pld_tokens=args.lookup, sampling=sampling,
                         tree=_tree_knobs(args))
    methods = build_methods(names, loaded, opts)
    summary = run_bench(loaded, questions, methods, args.max_new_tokens, Path(args.output), progress=not args.no_progress,
                        settings=_bench_settings(args, loaded), greedy=sampling.greedy)
    print(table(summary))
    print(f"answers, summary.json and plots in {args.output}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.bench.tune import PROMPTS, grid, report, tune
    from moaspec.drafters import load_drafter, shipped_drafter
    from moaspec.specbench import check_first_turns_fit, load_questions
    from moaspec.tuned import Decoding, machine_key, save_tuned, tuned_file

    _require(args, ">= 1", _at_least(1), "max_new_tokens", "limit")
    questions = load_questions(args.questions or PROMPTS, per_file=args.limit)
    loaded = _load(args)
    check_first_turns_fit(questions, loaded.tokenizer, loaded.cfg.max_position_embeddings)
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: train one with `moaspec train` and pass --drafter")
    drafter = load_drafter(path, loaded)
    key = machine_key(loaded, path, drafter)
    output = Path(args.output) if args.output else tuned_file(key).with_suffix("")
    settings = grid(loaded.model.device.type)
    print(f"moaspec tune: {len(settings)} settings and plain decoding on {len(questions)} prompts × "
          f"{args.max_new_tokens} tokens ({key['device']}, {key['threads'] or 'GPU'} threads); run in {output}",
          file=sys.stderr)
    best, summary = tune(loaded, drafter, questions, args.max_new_tokens, output, settings,
                         progress=not args.no_progress)
    print(report(summary, best, Decoding()))
    if args.no_save:
        return 0
    saved = save_tuned(key, best, {k: v["overall"] for k, v in summary["results"].items()})
    print(f"saved to {saved}: `moaspec generate`, `serve` and moaspec.load() now decode with {best.name()} for this "
          "target, drafter, device and thread count when no decoding option is given (--no-tuned, or deleting the "
          "file, restores the built-in default)")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import re

    import torch

    from moaspec.api import decoding_given
    from moaspec.serving import Engine, create_app, listen, run_server

    _require(args, ">= 1", _at_least(1), "parallel", "default_max_tokens", "max_body_bytes", "max_sessions", "max_draft")
    _require(args, ">= 0", _at_least(0), "max_queue", "prompt_cache_mb")
    _require(args, "in 0..65535", lambda v: 0 <= v < 65536, "port")
    _require(args, "a finite number > 0", _finite_positive, "session_ttl")
    sock = listen(args.host, args.port)  # fail on a taken port before loading anything
    # the cores this process may run on (taskset), not the machine's; macOS has no affinity to ask
    total = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not args.threads:  # share the cores between the parallel decoders instead of oversubscribing them
        torch.set_num_threads(max(1, total // args.parallel))  # before loading: packing measures
    loaded = _load(args)
    from moaspec.cores import Cores

    # a prefill alone may take every core (chosen threads, or one decoder, need no sharing; a GPU does not care)
    share = torch.get_num_threads()
    cores = Cores(total, share) if not args.threads and share < total and loaded.model.device.type == "cpu" else None
    from moaspec.clientserver.sessions import Limits, SessionStore
    from moaspec.decoding.prefill import PromptCache
    from moaspec.drafters import load_drafter, shipped_drafter
    from moaspec.drafters.moa import MoADrafter

    prompts = PromptCache(args.prompt_cache_mb << 20) if args.prompt_cache_mb else None
    engine = Engine(loaded, _strategy(args, loaded), parallel=args.parallel, max_queue=args.max_queue, prompt_cache=prompts,
                    cores=cores)
    moa = engine.strategy.drafter
    if moa is None and (path := args.drafter or shipped_drafter(loaded)):  # --no-draft: remote clients still draft
        moa = load_drafter(path, loaded)
    moas = [moa] if isinstance(moa, MoADrafter) else []  # none: remote MoA clients are refused, no LSA half here
    for path in args.remote_drafter:
        more = load_drafter(path, loaded)
        if not isinstance(more, MoADrafter):
            raise MoaspecError(f"--remote-drafter {path} is not a MoA drafter (EAGLE and independent clients need "
                               "no server half)")
        moas.append(more)
    limits = Limits(max_sessions=args.max_sessions, max_draft=args.max_draft, ttl_s=args.session_ttl)
    sessions = SessionStore(loaded, moas, limits, prompt_cache=prompts, cores=cores)
    name = args.served_model_name or re.sub(r"-[0-9a-f]{16}$", "", loaded.path.name).lower()
    api_key = args.api_key or os.environ.get("MOASPEC_API_KEY") or None
    app = create_app(engine, name, api_key=api_key, default_max_tokens=args.default_max_tokens,
                     max_body_bytes=args.max_body_bytes, sessions=sessions)
    host, port = sock.getsockname()[:2]
    tuned = f", tuned in {engine.strategy.tuned_from}" if engine.strategy.tuned_from else ""
    asked = decoding_given(args.chain, _tree_shape(args), args.lookup, args.draft_confidence)
    if not (tuned or asked or args.no_tuned or engine.strategy.drafter is None) and loaded.model.device.type == "cpu":
        # a setting saved by `moaspec tune` holds for one thread count, and each decoder here has its share of the cores
        tuned = (f", the built-in default: `moaspec tune --threads {torch.get_num_threads()}` with the same model and "
                 "drafter measures this machine's fastest for it")
    print(f"moaspec: serving {name} ({engine.strategy.describe()}{tuned}) on http://{host}:{port} — chat page at /, "
          f"OpenAI API at /v1{', key required' if api_key else ''}", file=sys.stderr, flush=True)
    run_server(app, sock, log_level=args.log_level)
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    from moaspec.chat import chat_messages, encode_chat
    from moaspec.clientserver.client import RemoteTarget, ServerUnreachable, SplitGeneration
    from moaspec.decoding import GenerationConfig, SamplingParams
    from moaspec.decoding.vanilla import stop_token_ids
    from moaspec.drafters import load_drafter, shipped_drafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.errors import PromptError

    prompt = _read_stdin() if args.prompt == "-" and not args.chat else args.prompt
    if args.chat and args.json:
        raise MoaspecError("--chat streams a conversation: not with --json")
    if (prompt is None and not args.chat) or (prompt is not None and not prompt.strip()):
        raise PromptError("the prompt is empty")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                              sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed))
    _require(args, ">= 1", _at_least(1), "chain", "max_new_tokens")
    _require(args, "a finite number > 0", _finite_positive, "timeout")
    _require(args, ">= 0", _at_least(0), "retries", "lookup")
    proxy, cut_after = None, None
    if args.network:
        from moaspec.clientserver.client import parse_server_url
        from moaspec.clientserver.netem import NetworkProxy, parse_profile

        try:
            profile, cut_after = parse_profile(args.network)
        except ValueError as exc:
            raise MoaspecError(str(exc)) from None
        proxy = NetworkProxy(parse_server_url(args.server), profile).start()
    if args.bundle:
        from moaspec.clientserver.bundle import bundle_drafter, load_bundle

        if args.model:
            raise MoaspecError("give either --bundle or --model, not both")
        loaded = load_bundle(args.bundle, args.device)
        args.drafter = args.drafter or str(bundle_drafter(args.bundle))
    else:
        loaded = _load(args)  # the client's side: tokenizer, embeddings and lm_head for the drafter
    remote = RemoteTarget(proxy.url if proxy else args.server, args.api_key or os.environ.get("MOASPEC_API_KEY"),
                          args.timeout, args.retries)
    try:
        info = remote.info()
    except ServerUnreachable as exc:
        raise MoaspecError(f"cannot reach {args.server}: {exc}") from None
    if info.get("fingerprint") != loaded.fingerprint:
        raise MoaspecError(f"the server's target ({info.get('fingerprint')}) is not this client's model "
                           f"({loaded.fingerprint}): pass the same --model as the server")
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: pass --drafter")
    drafter = load_drafter(path, loaded)
    if isinstance(drafter, MoADrafter) and drafter.fingerprint() not in info.get("moa_drafters", []):
        raise MoaspecError("the server holds a different MoA drafter (or none): start it with this client's drafter "
                           "(--drafter or --remote-drafter), whose server half (LSA) makes the memory this client reads")
    colours = {"draft": DRAFT_COLOUR, "unverified": UNVERIFIED_COLOUR, "target": ""}

    write: Writer = _show  # the chat swaps in its own each turn

    def piece(text: str, kind: str) -> None:
        if cut_after is not None and proxy is not None and len(gen.sink.tokens) >= cut_after:
            proxy.cut()
        if not args.json:
            write(text, colours[kind] if (args.show_drafts or kind == "unverified") else "")

    def event(text: str) -> None:
        print(f"\n[moaspec: {text}]", file=sys.stderr, flush=True)

    gen = SplitGeneration(drafter, loaded.tokenizer, remote, stop_token_ids(loaded.model, loaded.tokenizer),
                          draft_len=args.chain, confidence=args.draft_confidence, fmt=args.state_format,
                          max_draft=int(info["max_draft"]),
                          lookup=args.lookup, tree=_tree_shape(args), on_piece=piece, on_event=None if args.json else event)
    def unverified_note(result: Any) -> None:
        if result.unverified:
            print(f"[moaspec: the last {result.unverified} tokens ({UNVERIFIED_COLOUR}coloured{RESET}) were never "
                  "verified: the server stayed unreachable]", file=sys.stderr)

    def answer(ids: list[int], writer: Writer) -> None:
        nonlocal write
        write = writer
        unverified_note(gen.run(ids, config, loaded.cfg.max_position_embeddings))

    try:
        if args.chat:
            return _chat(loaded.tokenizer, answer, _chat_start(args, None, prompt))
        result = gen.run(encode_chat(loaded.tokenizer, chat_messages(prompt, args.system)), config,
                         loaded.cfg.max_position_embeddings)
    finally:
        remote.shutdown()
        if proxy is not None:
            proxy.stop()
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        unverified_note(result)
    return 0


def cmd_export_client(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.clientserver.bundle import export_bundle
    from moaspec.drafters import shipped_drafter

    loaded = _load(args)
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: pass --drafter")
    out = export_bundle(loaded, Path(path), Path(args.output))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"client bundle in {out}: {size / 2**20:.1f} MiB (run it with `moaspec client --bundle {out} --server URL`)")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    """The independent drafter as a plain ``LlamaForCausalLM`` directory, e.g. an ``assistant_model`` elsewhere."""
    from pathlib import Path

    from moaspec.drafters import load_drafter
    from moaspec.drafters.independent import IndependentDrafter, to_hf_llama
    from moaspec.fileio import atomic_write_dir

    loaded = _load(args)
    drafter = load_drafter(args.drafter, loaded, loaded.model.dtype)  # the checkpoint's precision, not drafting's
    if not isinstance(drafter, IndependentDrafter):
        raise MoaspecError(f"{args.drafter} is not an independent drafter: only those are standalone language models")
    model = to_hf_llama(drafter)

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), safe_serialization=True)
        loaded.tokenizer.save_pretrained(str(tmp))  # type: ignore[attr-defined]

    atomic_write_dir(args.output, write, marker="config.json")
    print(f"transformers model in {args.output} ({drafter.cfg.layers} layers; load it with "
          "AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_bench_cs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.bench.methods import require_drafter
    from moaspec.clientserver.bench import run_bench_cs, table
    from moaspec.clientserver.netem import PROFILES
    from moaspec.decoding import SamplingParams
    from moaspec.drafters import shipped_drafter
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.independent import IndependentDrafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.specbench import check_first_turns_fit, load_questions

    names = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in names if p not in PROFILES]
    if not names or bad:
        raise MoaspecError(f"--profiles takes a comma list from {', '.join(PROFILES)}" + (f"; not {', '.join(bad)}" if bad else ""))
    methods = _method_list(args.methods)
    _require(args, ">= 1", _at_least(1), "max_new_tokens", "chain", "lookup", "continue_tokens")
    _require(args, ">= 0", _at_least(0), "disconnect_after")
    if not 1 <= args.port <= 65535:
        raise MoaspecError(f"--port must be in 1..65535, got {args.port}")
    sampling = SamplingParams(args.temperature, top_p=args.top_p, seed=0 if args.seed is None else args.seed)
    questions = load_questions(args.questions, per_file=args.limit)
    loaded = _load(args)
    check_first_turns_fit(questions, loaded.tokenizer, loaded.cfg.max_position_embeddings)
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: pass --drafter")
    drafters = {"moa": require_drafter(str(path), MoADrafter, "moa", loaded)}
    more = [(p, require_drafter(p, MoADrafter, "the disconnection study", loaded))
            for p in (p.strip() for p in args.disconnect_drafters.split(",")) if p]
    depths = [d.cfg.tli_layers for d in ([drafters["moa"]] if "moa" in methods else []) + [d for _, d in more]]
    if len(set(depths)) < len(depths):
        raise MoaspecError(f"--disconnect-drafters: one MoA drafter per N (Target Layer Inference depth); got N = {depths}")
    for method, where, kind in (("eagle2", args.eagle_drafter, EagleDrafter),
                                ("independent", args.independent_drafter, IndependentDrafter)):
        if method in methods:
            drafters[method] = require_drafter(where, kind, method, loaded)
    summary = run_bench_cs(loaded, drafters, questions, [PROFILES[p] for p in names], methods, args.max_new_tokens,
                           Path(args.output), chain=args.chain, confidence=args.draft_confidence, lookup=args.lookup,
                           fmt=args.state_format,
                           tree=_tree_knobs(args),
                           disconnect_after=args.disconnect_after,
                           continue_tokens=args.continue_tokens, port=args.port,
                           model_spec=args.model, drafter_path=str(path), more_moa=more, progress=not args.no_progress,
                           settings=_bench_settings(args, loaded, "port"), sampling=sampling)
    print(table(summary))
    print(f"summary.json in {args.output}")
    return 0


def _method_list(text: str) -> list[str]:
    """``--methods`` of bench and bench-cs: a comma list of distinct names (each command checks the names)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or len(set(names)) != len(names):
        raise MoaspecError("--methods needs a comma list of distinct methods")
    return names


def _bench_settings(args: argparse.Namespace, loaded, *skip: str) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The options that shape a benchmark's methods, recorded in its summary (and checked when it resumes),
    with the dtypes and device the target and drafters actually ran in rather than "auto": a half-precision
    target's greedy answers may part from vanilla's, so a reader of the figures must see which it was."""
    from moaspec.drafters.checkpoint import drafting_dtype

    settings = {k: v for k, v in vars(args).items() if k not in ("output", "no_progress", *skip)}
    settings["drafter_dtype"] = str(drafting_dtype(loaded)).removeprefix("torch.")
    settings["target_dtype"] = str(loaded.model.dtype).removeprefix("torch.")
    settings["target_device"] = str(loaded.model.device)
    return settings


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import torch

    from moaspec.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "drafter_dtype", None):  # read where drafters load, here and in any server process started
        from moaspec.drafters.checkpoint import DTYPE_VARIABLE

        os.environ[DTYPE_VARIABLE] = args.drafter_dtype
    return load_model(args.model, device=args.device, dtype=args.dtype)


COMMANDS = {"generate": cmd_generate, "tune": cmd_tune, "data": cmd_data, "train": cmd_train, "serve": cmd_serve, "client": cmd_client,
            "export-client": cmd_export_client, "export-hf": cmd_export_hf, "bench": cmd_bench, "bench-cs": cmd_bench_cs}


def main(argv: Sequence[str] | None = None) -> int:
    from moaspec.heap import cap_kernel_caches

    cap_kernel_caches()  # before torch runs anything: a long-running server's memory stays flat
    args = build_parser().parse_args(argv)
    try:
        # data and train check their own; tune's default, in the cache, is made when it is needed
        if args.command in ("bench", "bench-cs", "export-client", "export-hf", "tune") and args.output is not None:
            from moaspec.fileio import check_output_dir

            check_output_dir(args.output)
        return COMMANDS[args.command](args)
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        if exc.errno not in DISK_ERRORS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"moaspec: error: {exc.strerror}{where}: {DISK_ERRORS[exc.errno]}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nmoaspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
