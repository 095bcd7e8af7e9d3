"""llama.cpp's own one-stream decode speed on this CPU, in process: the same GGUF, no HTTP, no server.

``bench.peers`` compares tokenpipe with llama-cpp-python's OpenAI server, whose Python work per token
(sampling, detokenizing, streaming) is part of what a user of that server gets. This measures the
engine under it: llama.cpp's decode step called in a loop from the peers virtualenv's Python, the next
token the argmax of the step's logits, after one prefill of a chat prompt. A server built on this
llama.cpp streams one stream at most about this fast here (less its own work a token), so it is the
stricter reference for "one stream against llama.cpp".

    python -m bench.llamaraw [--llama-python ~/.cache/tokenpipe/peers/bin/python] [--tokens 128] [--rounds 5]
                             [--context 1536]

It prints the features llama.cpp was built with, each round's tok/s and their median, and writes
``bench/out/llamaraw.json``. Compare it with ``bench.peers`` in the same minutes: the machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .common import cpu_summary, write_json
from .peers import LLAMA_PYTHON

__all__ = ["main"]

# Runs in the peers virtualenv (llama-cpp-python there, not here): one JSON line a round, the build first.
_CHILD = """
import json, sys, time
import llama_cpp
from llama_cpp import Llama
gguf, threads, tokens, rounds, context = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                          int(sys.argv[5]))
print(json.dumps({"build": llama_cpp.llama_print_system_info().decode().strip()}), flush=True)
window = max(512, context + tokens + 64)  # n_batch too: llama-cpp-python's scores hold n_batch rows
m = Llama(gguf, n_threads=threads, n_threads_batch=threads, n_ctx=window, n_batch=window, verbose=False)
story = b"Tell me a long story about a river."
if context:  # a document before the question, cut so that the whole prompt is `context` tokens
    doc = m.tokenize(b" ".join(b"Paragraph %d: the quick brown fox jumps over the lazy dog near the river." % i
                               for i in range(context // 8)), add_bos=False)
    head = m.tokenize(b"<|im_start|>user\\n")
    tail = m.tokenize(b" " + story + b"<|im_end|>\\n<|im_start|>assistant\\n", add_bos=False)
    prompt = head + doc[:max(context - len(head) - len(tail), 0)] + tail
else:
    prompt = m.tokenize(b"<|im_start|>user\\n" + story + b"<|im_end|>\\n<|im_start|>assistant\\n")
print(json.dumps({"prompt_tokens": len(prompt)}), flush=True)
for _ in range(rounds):
    m.reset()
    m.eval(prompt)
    tok = int(m.scores[m.n_tokens - 1].argmax())
    t0 = time.perf_counter()
    for _ in range(tokens):
        m.eval([tok])
        tok = int(m.scores[m.n_tokens - 1].argmax())
    print(json.dumps({"tok_s": tokens / (time.perf_counter() - t0)}), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.llamaraw", description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", default=str(LLAMA_PYTHON))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=0,
                    help="prompt tokens before the decode (a document, then the question); 0: a one-line chat prompt")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp's threads (default: every CPU, as bench.peers)")
    ap.add_argument("--out", default="bench/out/llamaraw.json")
    args = ap.parse_args(argv)

    from generator.model.preparation import _GGUF_FILE, _gguf_dir

    console = Console()
    cpu = cpu_summary()
    threads = args.threads or cpu["cores"] or 1
    gguf = _gguf_dir() / _GGUF_FILE
    if not Path(args.llama_python).exists():
        console.print(f"bench.llamaraw: no {args.llama_python}; install llama-cpp-python there first (bench/peers.py's "
                      "docstring says how)", soft_wrap=True)  # a path split over lines cannot be copied
        return 2
    console.print(f"[bold]bench.llamaraw[/] · {cpu['line']}; {threads} threads; {args.rounds} rounds of "
                  f"{args.tokens} tokens")
    proc = subprocess.Popen([args.llama_python, "-c", _CHILD, str(gguf), str(threads), str(args.tokens),
                             str(args.rounds), str(args.context)], stdout=subprocess.PIPE, text=True)
    build, rounds, prompt_tokens = "", [], 0
    assert proc.stdout is not None
    for line in proc.stdout:
        got = json.loads(line)
        if "build" in got:
            build = got["build"]
            console.print(f"llama.cpp built with: {build}")
        elif "prompt_tokens" in got:
            prompt_tokens = got["prompt_tokens"]
        else:
            rounds.append(got["tok_s"])
            console.print(f"  round {len(rounds)}/{args.rounds}: {got['tok_s']:.1f} tok/s")
    if proc.wait() != 0 or len(rounds) != args.rounds:
        console.print(f"bench.llamaraw: llama.cpp's run failed (exit {proc.returncode})")
        return 1
    table = Table(title="llama.cpp in process, one stream, greedy decode (no HTTP)")
    for col in ("rounds tok/s", "median tok/s", "ms a token"):
        table.add_column(col, justify="right")
    median = statistics.median(rounds)
    table.add_row(", ".join(f"{r:.1f}" for r in rounds), f"{median:.1f}", f"{1000 / median:.2f}")
    table.caption = (f"{cpu['line']}; {threads} threads; {args.tokens} tokens a round after one prefill of "
                     f"{prompt_tokens} tokens")
    console.print(table)
    write_json(args.out, {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                          "cpu": cpu, "build": build, "threads": threads, "tokens": args.tokens,
                          "prompt_tokens": prompt_tokens,
                          "rounds_tok_s": rounds, "tok_s": median}, indent=2)
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
