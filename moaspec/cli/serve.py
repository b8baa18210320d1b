"""``moaspec serve``: the OpenAI-compatible HTTP server, which also verifies for client–server clients."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from moaspec.cli import options
from moaspec.errors import MoaspecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    s.add_argument("--no-batch", action="store_true",
                   help="one target forward per request and step (default: once the requests' decoding steps and "
                        "client–server verifications outnumber the cores, those waiting run as one forward)")
    options.add_decoding_options(s)
    options.add_model_options(s, threads="the cores shared between the --parallel decoders, and all of them to a "
                                         "prompt read while nothing else runs; a number fixes every decoder's")
    options.add_drafter_dtype_option(s)


def run(args: argparse.Namespace) -> int:
    import torch

    from moaspec.models.sources import model_name
    from moaspec.serving import Engine, create_app, listen, run_server

    options.require(args, ">= 1", options.at_least(1), "parallel", "default_max_tokens", "max_body_bytes",
                    "max_sessions", "max_draft")
    options.require(args, ">= 0", options.at_least(0), "max_queue", "prompt_cache_mb")
    options.require(args, "in 0..65535", lambda v: 0 <= v < 65536, "port")
    options.require(args, "a finite number > 0", options.finite_positive, "session_ttl")
    if args.api_key is not None and not args.api_key.strip():  # `--api-key "$KEY"` with KEY unset
        raise MoaspecError("--api-key is empty (an unset shell variable?); give the key, or leave the option out "
                           "to serve without authentication")
    sock = listen(args.host, args.port)  # fail on a taken port before loading anything
    from moaspec.cores import Cores, usable_cores

    total = usable_cores()
    if not args.threads:  # share the cores between the parallel decoders instead of oversubscribing them
        torch.set_num_threads(max(1, total // args.parallel))  # before loading: packing measures
    loaded = options.load_target(args)
    # a prefill alone may take every core (chosen threads, or one decoder, need no sharing; a GPU does not care)
    share = torch.get_num_threads()
    cores = Cores(total, share) if not args.threads and share < total and loaded.model.device.type == "cpu" else None
    from moaspec.batching import ForwardBatcher
    from moaspec.clientserver.sessions import Limits, SessionStore
    from moaspec.decoding.prefill import PromptCache
    from moaspec.drafters import load_drafter, shipped_drafter
    from moaspec.drafters.moa import MoADrafter

    prompts = PromptCache(args.prompt_cache_mb << 20) if args.prompt_cache_mb else None
    # forwards run side by side while the cores have room (two on two cores beat both as one), together past that
    lanes = max(1, total // torch.get_num_threads()) if loaded.model.device.type == "cpu" else 1
    batcher = None if args.no_batch else ForwardBatcher(loaded.model, cores, lanes)
    engine = Engine(loaded, options.strategy_for(args, loaded), parallel=args.parallel, max_queue=args.max_queue,
                    prompt_cache=prompts, cores=cores, batcher=batcher)
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
    sessions = SessionStore(loaded, moas, limits, prompt_cache=prompts, cores=cores, batcher=batcher)
    name = args.served_model_name or model_name(loaded.path).lower()
    api_key = args.api_key or os.environ.get("MOASPEC_API_KEY") or None
    app = create_app(engine, name, api_key=api_key, default_max_tokens=args.default_max_tokens,
                     max_body_bytes=args.max_body_bytes, sessions=sessions)
    host, port = sock.getsockname()[:2]
    if api_key is None and not ipaddress.ip_address(host.split("%")[0]).is_loopback:
        print(f"moaspec: warning: serving on {args.host} without a key: anyone who reaches this port may use the "
              "model (--api-key or $MOASPEC_API_KEY requires one)", file=sys.stderr, flush=True)
    print(f"moaspec: serving {name} ({engine.strategy.describe()}) on http://{host}:{port} — chat page at /, "
          f"OpenAI API at /v1{', key required' if api_key else ''}", file=sys.stderr, flush=True)
    run_server(app, sock, log_level=args.log_level)
    return 0
