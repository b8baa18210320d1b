"""``moaspec export-client``: the bundle a client device runs ``moaspec client --bundle`` from."""

from __future__ import annotations

import argparse

from moaspec.cli import options
from moaspec.errors import MoaspecError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser("export-client", help="write what a client device needs: embeddings, drafter, tokenizer, and the last N layers for a TLI drafter (not the whole target)")
    e.add_argument("--output", required=True, help="directory for the bundle (written atomically)")
    e.add_argument("--drafter", default=None, help="MoA (any N), EAGLE or independent drafter (default: the MoA one shipped for the target)")
    options.add_model_options(e)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.clientserver.bundle import export_bundle
    from moaspec.drafters import shipped_drafter

    loaded = options.load_target(args)
    path = args.drafter or shipped_drafter(loaded)
    if path is None:
        raise MoaspecError(f"no drafter ships for {loaded.path.name}: pass --drafter")
    out = export_bundle(loaded, Path(path), Path(args.output))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"client bundle in {out}: {size / 2**20:.1f} MiB (run it with `moaspec client --bundle {out} --server URL`)")
    return 0
