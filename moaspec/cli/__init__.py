"""The ``moaspec`` command.

Every user mistake ends as one line on stderr and exit code 2; an interrupted run
exits 130. Tracebacks are reserved for bugs.

Each command's module holds its options (``add_parser``) beside the code that runs it (``run``); ``options``
holds what several commands share, ``chat`` the terminal side of generate and client.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

from moaspec.cli import bench, bench_cs, client, data, export_client, export_hf, generate, serve, train, tune
from moaspec.errors import MoaspecError

EXIT_USAGE = 2
# what the machine, not moaspec, refused, and what to do; every file is written atomically, so what was
# being written is simply absent
DISK_ERRORS = {
    errno.ENOSPC: "free some space and run the command again (data, train, bench, bench-cs and tune resume where they stopped)",
    errno.EDQUOT: "the disk quota is used up; free some space and run the command again",
    errno.EACCES: "check its permissions, or choose another place",
    errno.EROFS: "the file system is read-only; choose another place",
    errno.EFBIG: "the file is larger than this file system or the shell's limit (ulimit -f) allows; choose another place",
}
# each command's module, in the order `moaspec --help` lists them: add_parser(sub) defines its options, run(args) runs it
_MODULES = {"generate": generate, "tune": tune, "bench": bench, "data": data, "train": train, "serve": serve,
            "client": client, "export-client": export_client, "bench-cs": bench_cs, "export-hf": export_hf}
COMMANDS = {name: module.run for name, module in _MODULES.items()}


def disk_error_in(exc: Exception) -> int | None:
    """The errno of a refused write that safetensors reported (``SafetensorError: ... I/O error: File too large
    (os error 27)``), if it is one of :data:`DISK_ERRORS`."""
    from safetensors import SafetensorError

    if not isinstance(exc, SafetensorError):
        return None
    found = re.search(r"\(os error (\d+)\)", str(exc))
    code = int(found.group(1)) if found else None
    return code if code in DISK_ERRORS else None


class CommandParser(argparse.ArgumentParser):
    """The top parser. An option the command does not take is reported with the command's usage (argparse's own
    reports it with the top one, ``moaspec [-h] COMMAND ...``, which lists no option at all)."""

    commands: dict[str, argparse.ArgumentParser]

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.commands[parsed.command].error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed


def build_parser() -> CommandParser:
    parser = CommandParser(prog="moaspec", description="Mixture of Attentions speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _MODULES.values():
        module.add_parser(sub)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from moaspec.heap import cap_kernel_caches

    cap_kernel_caches()  # before torch runs anything: a long-running server's memory stays flat
    args = build_parser().parse_args(argv)
    try:
        # data and train check their own; tune's default, in the cache, is made when it is needed
        if args.command in ("bench", "bench-cs", "export-client", "export-hf", "tune") and args.output is not None:
            from moaspec.fileio import check_output_dir

            # a benchmark's directory: its summary marks a finished run, its journals and plots come before
            # (the exports write whole directories, which refuse other files themselves)
            marker, own = ("summary.json", ("*.jsonl", "*.png")) if "bench" in args.command or args.command == "tune" \
                else (None, ())
            check_output_dir(args.output, marker, own)
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader that left is found here, not by the interpreter at exit
        return code
    except BrokenPipeError:
        # the reader of the output left (`| head`): stop quietly, as any Unix tool does, with SIGPIPE's status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        if exc.errno not in DISK_ERRORS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"moaspec: error: {exc.strerror}{where}: {DISK_ERRORS[exc.errno]}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # safetensors reports a failed write as its own error, naming the OS error in its text
        code = disk_error_in(exc)
        if code is None:
            raise
        print(f"moaspec: error: writing a safetensors file failed ({os.strerror(code)}): {DISK_ERRORS[code]}",
              file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nmoaspec: interrupted", file=sys.stderr)
        return 130
