"""A drafter as a few self-contained safetensors files under a size limit, and back.

A run on a borrowed machine brings back only a few files of bounded size. A drafter
directory (``config.json`` + ``model.safetensors``) is packed into ``STEM.safetensors``,
or ``STEM.part1-of-N.safetensors`` ... when its weights outgrow one file, each part
carrying the drafter's ``config.json`` in its metadata, so that the files alone rebuild
the directory and a later run can continue from it (``--init-from``). The weights keep
the dtype they were exported in (fp16, the shipped drafters' own), so unpacking gives
back exactly the exported drafter.

    python -m moaspec.training.carry pack RUN/drafter RESULTS/moa [--max-bytes N]
    python -m moaspec.training.carry unpack RESULTS/moa DRAFTER_DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moaspec.drafters.checkpoint import read_meta
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write, atomic_write_dir

MAX_BYTES = 16 * 2**20  # the largest file a run may bring back
HEADER_ROOM = 64 * 1024  # the safetensors header: tensor names, offsets and the drafter's config
CONFIG_KEY = "moaspec_drafter_config"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def split_tensors(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Group the tensors, in name order, into as few parts as fit ``limit`` bytes of data each."""
    parts: list[dict[str, torch.Tensor]] = [{}]
    for name in sorted(tensors):
        t = tensors[name]
        if nbytes(t) > limit:
            raise MoaspecError(f"the drafter's tensor {name} takes {nbytes(t):,} bytes, more than a packed file may "
                               f"hold ({limit:,}); raise --max-bytes")
        if parts[-1] and sum(map(nbytes, parts[-1].values())) + nbytes(t) > limit:
            parts.append({})
        parts[-1][name] = t
    return parts


def part_path(stem: Path, k: int, n: int) -> Path:
    return stem.with_name(f"{stem.name}.safetensors" if n == 1 else f"{stem.name}.part{k}-of-{n}.safetensors")


def pack(drafter: Path, stem: Path, max_bytes: int = MAX_BYTES) -> list[Path]:
    """Write ``drafter`` as ``stem``'s packed files, each at most ``max_bytes``; returns them in order."""
    read_meta(drafter)  # a moaspec drafter, whole
    config = (drafter / "config.json").read_text()
    if len(config.encode()) + 4096 > HEADER_ROOM:
        raise MoaspecError(f"{drafter / 'config.json'} is too long to travel in a packed file's header")
    parts = split_tensors(load_file(str(drafter / "model.safetensors")), max_bytes - HEADER_ROOM)
    for old in stem.parent.glob(f"{stem.name}.*safetensors"):  # an earlier packing of another size
        old.unlink()
    paths = [part_path(stem, k, len(parts)) for k in range(1, len(parts) + 1)]
    for k, (path, part) in enumerate(zip(paths, parts), 1):
        atomic_write(path, writer(part, {CONFIG_KEY: config, "part": f"{k}/{len(parts)}"}))
    return paths


def writer(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Callable[[Path], None]:
    """What writes one packed file (bound now: the loop's next part must not replace it)."""
    def write(path: Path) -> None:
        save_file(tensors, str(path), metadata=meta)
    return write


def packed_files(stem: Path) -> list[Path]:
    """``stem``'s packed files in order, checked to be one whole packing."""
    whole = part_path(stem, 1, 1)
    if whole.is_file():
        return [whole]
    found: dict[int, Path] = {}
    totals = set()
    for path in stem.parent.glob(f"{stem.name}.part*-of-*.safetensors"):
        m = re.fullmatch(re.escape(stem.name) + r"\.part(\d+)-of-(\d+)\.safetensors", path.name)
        if m:
            found[int(m[1])] = path
            totals.add(int(m[2]))
    if not found:
        raise MoaspecError(f"no packed drafter {whole.name} (or {stem.name}.partK-of-N.safetensors) in {stem.parent}")
    if len(totals) != 1 or sorted(found) != list(range(1, totals.pop() + 1)):
        raise MoaspecError(f"the packed drafter {stem} is incomplete or mixes two packings: {sorted(p.name for p in found.values())}")
    return [found[k] for k in sorted(found)]


def unpack(stem: Path, drafter: Path) -> Path:
    """Rebuild the drafter directory packed as ``stem`` at ``drafter``."""
    tensors: dict[str, torch.Tensor] = {}
    configs = set()
    for path in packed_files(stem):
        with safe_open(str(path), "pt") as f:
            configs.add((f.metadata() or {}).get(CONFIG_KEY))
        tensors.update(load_file(str(path)))
    if len(configs) != 1 or None in configs:
        raise MoaspecError(f"the packed drafter {stem}'s parts do not carry one drafter's config")
    config = configs.pop()
    assert config is not None
    json.loads(config)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(config)

    atomic_write_dir(drafter, write, marker="config.json")
    read_meta(drafter)
    return drafter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moaspec.training.carry", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="DRAFTER_DIR -> STEM.safetensors or STEM.partK-of-N.safetensors")
    p.add_argument("drafter", type=Path)
    p.add_argument("stem", type=Path)
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES)
    u = sub.add_parser("unpack", help="STEM's packed files -> DRAFTER_DIR")
    u.add_argument("stem", type=Path)
    u.add_argument("drafter", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.verb == "pack":
            for path in pack(args.drafter, args.stem, args.max_bytes):
                print(path)
        else:
            print(unpack(args.stem, args.drafter))
    except MoaspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
