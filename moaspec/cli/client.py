"""``moaspec client``: draft on this machine, verify on a ``moaspec serve`` server."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from moaspec.cli import options
from moaspec.cli.chat import DRAFT_COLOUR, RESET, UNVERIFIED_COLOUR, Writer, chat_loop, chat_start, read_stdin, show
from moaspec.errors import MoaspecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("client", help="draft here, verify on a `moaspec serve` server (keeps generating if it goes away)")
    c.add_argument("prompt", nargs="?", default=None, help="the user message ('-' reads it from stdin)")
    c.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    c.add_argument("--api-key", default=None, help="bearer token (default: $MOASPEC_API_KEY)")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--chat", action="store_true",
                   help="a conversation, as generate --chat: each turn the server reads only what is new, and a MoA "
                        "client keeps its drafter's state of the conversation, so the server sends only the new tokens'")
    c.add_argument("--drafter", default=None, help="MoA (any N), EAGLE or independent drafter (default: the MoA one shipped for the target)")
    c.add_argument("--chain", type=int, default=options.default_chain(), metavar="T",
                   help=f"drafts per verification (default {options.default_chain()}, as for generate)")
    options.add_confidence_option(c)
    c.add_argument("--lookup", type=int, default=options.default_lookup(), metavar="N",
                   help="prompt lookup: send up to N drafts copied from where the newest tokens occurred before, and "
                        f"the drafter's chain only where nothing matches; 0: off (default {options.default_lookup()}). "
                        "Offline, the drafter alone writes")
    c.add_argument("--tree", action="store_true", help="send EAGLE-2 dynamic draft trees instead of chains")
    options.add_tree_options(c)
    c.add_argument("--state-format", choices=("fp16", "int8"), default="fp16", help="how the server sends each verified token's state (default fp16)")
    c.add_argument("--timeout", type=float, default=10.0,
                   help="seconds before a request counts as lost (default 10; opening a session waits 10 ms more per "
                        "prompt token, for the server to read the prompt)")
    c.add_argument("--retries", type=int, default=2, help="retries of a lost request before going offline (default 2)")
    c.add_argument("--max-new-tokens", type=int, default=256)
    options.add_sampling_options(c, "seed for sampling (the server's draws, and the client's while it writes alone)")
    options.add_penalty_options(c)
    c.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    c.add_argument("--bundle", default=None, help="run from a client bundle (`moaspec export-client`) instead of the whole target")
    c.add_argument("--network", default=None, metavar="PROFILE",
                   help="go through an emulated link: lan, 4g, 5g, optionally +offline-after:K (the link dies after "
                        "K tokens), e.g. 4g+offline-after:32")
    c.add_argument("--json", action="store_true", help="print one JSON object (text, tau, server calls, bytes/token)")
    options.add_logprobs_option(c)
    c.add_argument("--show-drafts", action="store_true", help="colour text from accepted drafts")
    options.add_model_options(c)
    options.add_drafter_dtype_option(c)


def run(args: argparse.Namespace) -> int:
    from moaspec.chat import chat_messages, encode_chat
    from moaspec.clientserver.client import RemoteTarget, ServerUnreachable, SplitGeneration
    from moaspec.decoding import GenerationConfig
    from moaspec.decoding.opening import stop_token_ids
    from moaspec.drafters import load_drafter, shipped_drafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.errors import PromptError

    prompt = read_stdin() if args.prompt == "-" and not args.chat else args.prompt
    if args.chat and args.json:
        raise MoaspecError("--chat streams a conversation: not with --json")
    if (prompt is None and not args.chat) or (prompt is not None and not prompt.strip()):
        raise PromptError("the prompt is empty")
    options.require_json_for_logprobs(args)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop),
                              sampling=options.sampling_params(args), logprobs=args.logprobs)
    options.require(args, ">= 1", options.at_least(1), "chain", "max_new_tokens")
    options.require(args, "a finite number > 0", options.finite_positive, "timeout")
    options.require(args, ">= 0", options.at_least(0), "retries", "lookup")
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
        loaded = options.load_target(args)  # the client's side: tokenizer, embeddings and lm_head for the drafter
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

    write: Writer = show  # the chat swaps in its own each turn

    def piece(text: str, kind: str) -> None:
        if cut_after is not None and proxy is not None and len(gen.sink.tokens) >= cut_after:
            proxy.cut()
        if not args.json:  # unverified text is coloured on a terminal even without --show-drafts; a pipe gets no codes
            write(text, colours[kind] if (args.show_drafts or (kind == "unverified" and sys.stdout.isatty())) else "")

    def event(text: str) -> None:
        print(f"\n[moaspec: {text}]", file=sys.stderr, flush=True)

    gen = SplitGeneration(drafter, loaded.tokenizer, remote, stop_token_ids(loaded.model, loaded.tokenizer),
                          draft_len=args.chain, confidence=args.draft_confidence, fmt=args.state_format,
                          max_draft=int(info["max_draft"]),
                          lookup=args.lookup, tree=options.tree_shape(args), on_piece=piece,
                          on_event=None if args.json else event)
    def unverified_note(result: Any) -> None:
        if result.unverified:
            marked = f" ({UNVERIFIED_COLOUR}coloured{RESET})" if sys.stdout.isatty() and sys.stderr.isatty() else ""
            print(f"[moaspec: the last {result.unverified} tokens{marked} were never verified: the server stayed "
                  "unreachable]", file=sys.stderr)

    def answer(ids: list[int], writer: Writer) -> None:
        nonlocal write
        write = writer
        unverified_note(gen.run(ids, config, loaded.cfg.max_position_embeddings))

    try:
        if args.chat:
            return chat_loop(loaded.tokenizer, answer, chat_start(args, None, prompt))
        result = gen.run(encode_chat(loaded.tokenizer, chat_messages(prompt, args.system)), config,
                         loaded.cfg.max_position_embeddings)
    finally:
        remote.shutdown()
        if proxy is not None:
            proxy.stop()
    if args.json:
        out = result.to_dict()
        if result.logprobs is not None:  # the verified tokens' (an unverified tail has none)
            out["logprobs"] = options.logprobs_json(loaded.tokenizer, result.logprobs)
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        unverified_note(result)
    return 0
