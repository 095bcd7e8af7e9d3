"""What per-tenant NATS accounts cost the producer SDK (issue 24), A/B in one run.

    python -m bench.accounts [--model tiny-random] [--streams 32] [--max-tokens 64] [--rounds 3]

Two nats-servers, each with a generator process (``TOKENPIPE_THREADS=1``): **one account** (an
open bus; the producer as app ``bench``: the same SDK code path, everything in one account) and
**own account** (tokenpipe's accounts, tokenpipe.natsconfig: ``app-bench``'s requests cross a
service import, its tokens a stream import into its own ``TP_TOKENS``, read there). The two
producers take turns, alternating the order round by round so both see the same machine. Each
round: TTFT at one stream (submit to first batch, ``--ttft`` requests), then ``--streams``
concurrent streams (aggregate tokens/s). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from producer import Producer
from tokenpipe.natsauth import add_app
from tokenpipe.natsconfig import write_server_config
from tokenpipe.settings import Settings
from tokenpipe_cli.launch import Child, spawn_role, wait_ready
from tokenpipe_cli.natsserver import NatsServer
from tokenpipe_cli.provisioner import Provisioner


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft", type=int, default=10, help="single-stream TTFT samples per round and variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data-dir", default=Settings.load().data_dir, help="where the model cache is")
    p.add_argument("--work-dir", default="bench/out/accounts")
    p.add_argument("--out", default="bench/out/accounts.json")
    return p.parse_args(argv)


async def _one(p: Producer, model: str, max_tokens: int, i: int) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    handle = await p.submit(model, prompt=f"Tell me about number {i}", max_tokens=max_tokens, temperature=0,
                            ignore_eos=True)
    first = 0.0
    n = 0
    async for batch in handle:
        if not first and batch.token_ids:
            first = time.perf_counter() - t0
        n += len(batch.token_ids)
    return first, n, time.perf_counter() - t0


async def _round(p: Producer, args: argparse.Namespace) -> dict[str, Any]:
    ttfts = [(await _one(p, args.model, 4, i))[0] for i in range(args.ttft)]
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_one(p, args.model, args.max_tokens, i) for i in range(args.streams)))
    wall = time.perf_counter() - t0
    return {"ttft_ms": [t * 1000 for t in ttfts], "tokens": sum(n for _, n, _ in res), "wall_s": wall,
            "tok_s": sum(n for _, n, _ in res) / wall}


def _generator(work: Path, url: str, args: argparse.Namespace, *creds: str) -> Child:
    ready = work / "gen.ready"
    ready.unlink(missing_ok=True)
    gen = spawn_role("generator", "--nats-url", url, *creds, "--data-dir", args.data_dir, "--model", args.model,
                     "--device", "cpu", "--dtype", "float32", name="generator", new_session=True,
                     log=work / "generator.log", env={**os.environ, "TOKENPIPE_READY_FILE": str(ready),
                                                      "TOKENPIPE_THREADS": "1"})
    wait_ready(lambda: ready.exists() and ready.read_text().strip() == str(gen.pid), timeout=300,
               what="the generator", children=[gen])
    return gen


async def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    (work / "open").mkdir(parents=True)
    (work / "acc").mkdir(parents=True)
    creds = work / "acc" / "creds"
    add_app(creds, "bench")
    conf = write_server_config(work / "acc" / "nats" / "nats-server.conf", creds)
    open_server = NatsServer(work / "open" / "nats").start()
    acc_server = NatsServer(work / "acc" / "nats", config_file=conf).start()
    base = Settings.load(env={}, data_dir=args.data_dir)
    prov = Provisioner(base, acc_server.url, creds / "admin.json").start()
    gens: list[Child] = []
    out: dict[str, list[dict[str, Any]]] = {"one account": [], "own account": []}
    try:
        gens.append(_generator(work / "open", open_server.url, args))  # an open bus: it provisions
        gens.append(_generator(work / "acc", acc_server.url, args, "--nats-creds", str(creds / "generator.json")))
        producers = {
            # The same SDK code path (an app's own owner name, no registry), all in one account.
            "one account": await Producer.connect(settings=base.replace(nats_url=open_server.url, app_name="bench")),
            "own account": await Producer.connect(settings=base.replace(nats_url=acc_server.url,
                                                                        nats_creds=str(creds / "app-bench.json"))),
        }
        for p in producers.values():  # warm-up
            await _one(p, args.model, 8, 999)
        for r in range(args.rounds):
            for name in (list(out) if r % 2 == 0 else list(reversed(out))):
                res = await _round(producers[name], args)
                out[name].append(res)
                console.print(f"round {r + 1}/{args.rounds} {name}: {res['tok_s']:.0f} tok/s, "
                              f"TTFT p50 {statistics.median(res['ttft_ms']):.1f} ms")
        for p in producers.values():
            await p.close()
    finally:
        for g in gens:
            g.stop(30)
        prov.stop()
        acc_server.stop()
        open_server.stop()
    return {k: {"tok_s": statistics.mean(r["tok_s"] for r in v),
                "ttft_p50_ms": statistics.median(t for r in v for t in r["ttft_ms"]),
                "rounds": v} for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    results = asyncio.run(run(args, console))
    a, b = results["one account"], results["own account"]
    table = Table(title=f"{args.streams} concurrent streams × {args.max_tokens} tokens, {args.model}, "
                        f"{args.rounds} alternating rounds")
    for col in ("variant", "tokens/s", "TTFT p50 (ms)"):
        table.add_column(col)
    for name, r in results.items():
        table.add_row(name, f"{r['tok_s']:.0f}", f"{r['ttft_p50_ms']:.1f}")
    table.add_row("own / one", f"{b['tok_s'] / a['tok_s']:.3f}", f"{b['ttft_p50_ms'] - a['ttft_p50_ms']:+.1f} ms")
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
