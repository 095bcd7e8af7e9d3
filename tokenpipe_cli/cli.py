"""The ``tokenpipe`` command: parses the command line and starts the role or tool it names."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, get_type_hints

from tokenpipe.errors import ConfigError, InvalidRequest, TokenpipeError
from tokenpipe.eventloop import run
from tokenpipe.logs import setup_logging
from tokenpipe.settings import ENV_PREFIX, Settings
from tokenpipe.settings_doc import shown_default

from .forkserver import ForkServer

__all__ = ["main"]


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_TYPES = get_type_hints(Settings)


# The connection and logging settings every NATS client command takes, and the model's.
_COMMON = ("nats_url", "data_dir", "log_level", "log_json", "nats_creds", "nats_user", "nats_ca", "nats_cert",
           "nats_key")
_MODEL = ("model", "model_path", "device", "dtype", "quant")
# generator.kernels.levels.LEVELS' names: the parser must not import the generator (a base install has no torch)
_LEVELS = ("avx2", "avx512", "avx512vnni", "amx")


def _settings(p: argparse.ArgumentParser, *names: str) -> None:
    """``--<name>`` for each name: sets ``Settings.<name>``; its help is the field's own documentation
    (README.md's table is rendered from the same text), so the two cannot drift apart."""
    for name in names:
        f, typ = _FIELDS[name], _TYPES[name]
        text = f"{f.metadata['doc']} (env {ENV_PREFIX}{name.upper()}; default {shown_default(f)})"
        text = text.replace("`", "").replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            p.add_argument(flag, action="store_true", default=None, help=text)
        else:
            p.add_argument(flag, type=typ if typ in (int, float) else str, choices=Settings.choices(name) or None,
                           help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenpipe", description="Streaming token pipeline over NATS JetStream")
    sub = parser.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start nats-server, generator(s) and the relay on this machine")
    _settings(up, *_COMMON, *_MODEL, "host", "port")
    up.add_argument("--generators", type=int, default=1, help="generator processes (default 1)")
    up.add_argument("--nats-port", type=int, default=None,
                    help="embedded nats-server port (default 4222, or a free one when that is taken)")
    up.add_argument("--nats-cluster", type=int, default=1, metavar="N",
                    help="run the embedded NATS as a local N-node JetStream cluster (e.g. 3: R3 streams, "
                         "a node can fail)")

    gen = sub.add_parser("generator", help="run one generator worker")
    _settings(gen, *_COMMON, *_MODEL, "max_batch", "engine_process", "cuda_graphs", "metrics_port")

    relay = sub.add_parser("relay", help="run the HTTP/SSE relay")
    _settings(relay, *_COMMON, "host", "port", "model")

    nats = sub.add_parser("nats", help="run nats-server with JetStream in the foreground")
    nats.add_argument("--data-dir")
    nats.add_argument("--host", default="127.0.0.1")
    nats.add_argument("--port", type=int, default=4222)
    nats.add_argument("--monitor-port", type=int, default=None)
    nats.add_argument("--auth", action="store_true",
                      help="authorization on: one user per role, credentials created in --creds-dir")
    nats.add_argument("--creds-dir", help="where --auth keeps the credentials (default: <data dir>/creds)")
    nats.add_argument("--tls-cert", help="serve TLS with this certificate")
    nats.add_argument("--tls-key", help="the certificate's key")
    nats.add_argument("--tls-ca", help="CA for client certificates")
    nats.add_argument("--tls-verify", action="store_true", help="require client certificates signed by --tls-ca")
    nats.add_argument("--cluster-name", help="join a JetStream cluster of this name (needs --server-name)")
    nats.add_argument("--cluster-port", type=int, default=6222, help="route port for the other nodes (default 6222)")
    nats.add_argument("--routes", default="", help="the other nodes, e.g. nats-route://10.0.0.2:6222,nats-route://...")
    nats.add_argument("--server-name", help="this node's unique name in the cluster")

    creds = sub.add_parser("creds", help="NATS credentials for the embedded server (tokenpipe up / nats --auth)")
    creds.add_argument("action", choices=["add-app"], help="add-app NAME: credentials for an application (SDK)")
    creds.add_argument("name")
    creds.add_argument("--creds-dir", help="default: <data dir>/creds")

    prov = sub.add_parser("provision", help="as the admin: create tokenpipe's streams (and, --watch, keep them so)")
    _settings(prov, *_COMMON)
    prov.add_argument("--watch", action="store_true",
                      help="keep running: re-create what is deleted, restore what is reconfigured (Kubernetes)")

    prep = sub.add_parser("prepare", help="convert and cache the default model (one-time, ~20 s)")
    prep.add_argument("--data-dir")

    kern = sub.add_parser("build-kernels", help="compile the native kernel library for every x86 level "
                          "(make install runs it; skipped where up to date)")
    kern.add_argument("--out", help="directory for the objects (default: <venv>/share/tokenpipe/kernels, where "
                      "the generator looks first)")
    kern.add_argument("--level", action="append", default=[], choices=_LEVELS,
                      help="build only this level (repeatable; default every one)")
    kern.add_argument("--strict", action="store_true",
                      help="exit 1 where nothing can be built (no compiler, not x86-64), as the image's build does")

    submit = sub.add_parser("submit", help="submit a prompt over NATS and stream the answer, or (--batch) a JSONL "
                                           "file of requests through the relay's Batch API")
    _settings(submit, *_COMMON)
    submit.add_argument("prompt", nargs="?")
    submit.add_argument("--batch", metavar="FILE", type=Path, default=None,
                        help="run FILE (JSONL: custom_id, method, url, body per line) as a batch at the batch class; "
                             "shows progress, writes FILE.output.jsonl (and .errors.jsonl)")
    submit.add_argument("--url", default=None, help="--batch: the relay (default: the one `tokenpipe up` runs)")
    submit.add_argument("--api-key", default="", help="--batch: the relay's API key, when keys are on")
    submit.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=["/v1/chat/completions", "/v1/completions"], help="--batch: every line's url")
    submit.add_argument("--output", type=Path, default=None, help="--batch: where the output lines go")
    submit.add_argument("--model", default=None)
    submit.add_argument("--raw", action="store_true", help="send as a plain prompt, not a chat message")
    submit.add_argument("--max-tokens", type=int, default=256)
    submit.add_argument("--temperature", type=float, default=0.7)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--json", action="store_true", help="print each batch as a JSON line")
    bench = sub.add_parser("bench", help="load-test a running pipeline (TTFT, TPOT, ITL, E2E, tokens/s)")
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="relay URL")
    bench.add_argument("--api", choices=["native", "openai", "sdk"], default="native")
    bench.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="for --api sdk")
    bench.add_argument("--model", default=None)
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--concurrency", type=int, default=8)
    bench.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (instead of concurrency)")
    bench.add_argument("--num-requests", type=int, default=64)
    bench.add_argument("--duration", dest="duration_s", metavar="DURATION", type=float, default=None,
                       help="stop starting requests after this many s")
    bench.add_argument("--prompt-words", type=int, default=24)
    bench.add_argument("--output-len", default="128", help="tokens per request: N or A-B (uniform)")
    bench.add_argument("--coalesce-max-tokens", type=int, default=None)
    bench.add_argument("--coalesce-max-delay-ms", type=float, default=None)
    bench.add_argument("--json", dest="json_out", default=None, help="write the summary and records here")
    bench.add_argument("--plot", default=None, help="write latency CDFs as a PNG here")

    rep = sub.add_parser("replay", help="print a kept stream with its original pacing")
    _settings(rep, *_COMMON)
    rep.add_argument("id")
    rep.add_argument("--speed", type=float, default=1.0, help="pacing factor; 0 = as fast as possible")
    rep.add_argument("--json", action="store_true",
                     help="the whole stream as one JSON document (request, batches, timings; the inspector's format)")
    rep.add_argument("--jsonl", action="store_true", help="one JSON object per batch as it is replayed")
    rep.add_argument("--from", dest="from_seq", type=int, default=0, help="start at this batch seq")

    streams = sub.add_parser("streams", help="list recent streams")
    _settings(streams, *_COMMON)
    streams.add_argument("--limit", type=int, default=20)

    tail = sub.add_parser("tail", help="follow all live streams (Ctrl-C stops)")
    _settings(tail, *_COMMON)
    tail.add_argument("--model", default=None, help="only this model's streams")
    return parser


# What each extra brings (pyproject.toml), by import name: a role command checks for its extra
# before importing the role, so a base install says what to install instead of a traceback.
_EXTRAS = {"relay": ("fastapi", "uvicorn"), "generator": ("torch", "transformers", "gguf", "safetensors")}
_NEEDS = {"up": ("relay", "generator"), "relay": ("relay",), "generator": ("generator",), "prepare": ("generator",),
          "build-kernels": ("generator",)}


def require_extras(cmd: str) -> None:
    """Raise :class:`ConfigError` naming the extra to install when ``tokenpipe cmd`` cannot run here."""
    extras = _NEEDS.get(cmd, ())
    missing = [m for extra in extras for m in _EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        extra = "all" if len(extras) > 1 else extras[0]
        raise ConfigError(f"`tokenpipe {cmd}` needs the {extra!r} extra (missing: {', '.join(missing)}): "
                          f"pip install 'tokenpipe[{extra}]'")


def main(argv: list[str] | None = None, *, forks: ForkServer | None = None) -> int:
    """The ``tokenpipe`` command after its arguments are parsed (``forks``: ``tokenpipe up``'s fork server,
    started before this module was imported: :func:`tokenpipe_cli.main`)."""
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args, forks)
    except TokenpipeError as exc:
        print(f"tokenpipe: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace, forks: ForkServer | None = None) -> int:
    require_extras(args.cmd)
    if args.cmd == "nats":
        from .clusternode import node_args
        from .natsserver import NatsServer

        cluster = None
        if args.cluster_name is not None:
            cluster = node_args(args.cluster_name, args.cluster_port, args.routes, args.server_name)
        # Nodes of one cluster on one host must not share a store.
        default_dir = "nats" if cluster is None else f"nats-{cluster.server_name}"
        data = args.data_dir or str(Path(Settings.load().data_dir) / default_dir)
        setup_logging("nats")
        server = NatsServer(data, host=args.host, port=args.port, monitor_port=args.monitor_port,
                            config_file=_nats_config(args, data), tls=bool(args.tls_cert), cluster=cluster)
        server.start()
        provisioner = None
        try:
            if args.auth and cluster is None and not args.tls_cert:
                # Only the admin configures streams where there are users: this process is it.
                from .provisioner import Provisioner

                creds_dir = args.creds_dir or Path(Settings.load().data_dir) / "creds"
                provisioner = Provisioner(Settings.load(), server.url, Path(creds_dir) / "admin.json").start()
            elif args.auth:
                print("tokenpipe: only the admin creates tokenpipe's streams: run `tokenpipe provision --watch` "
                      "with admin.json (and the TLS settings) once the cluster is up", file=sys.stderr)
            return server.wait()
        finally:
            if provisioner is not None:
                provisioner.stop()
            server.stop()
    if args.cmd == "creds":
        from tokenpipe.natsauth import add_app
        from tokenpipe.natsconfig import write_accounts

        from .natsserver import reload_servers

        data_dir = Path(Settings.load().data_dir)
        creds_dir = Path(args.creds_dir) if args.creds_dir else data_dir / "creds"
        print(add_app(creds_dir, args.name))
        write_accounts(creds_dir, Settings.load())  # the file the running servers' configuration includes
        pids = reload_servers(data_dir)
        print(f"nats-server reloaded ({len(pids)} running): the account is live" if pids else
              "no running nats-server found under the data dir: the account is live at its next start",
              file=sys.stderr)
        return 0
    if args.cmd == "prepare":
        from generator.model.preparation import prepare_smollm2

        print(prepare_smollm2(args.data_dir or Settings.load().data_dir))
        return 0
    if args.cmd == "build-kernels":
        from generator.kernels.install import build_kernels

        return build_kernels(args.out, args.level, strict=args.strict)
    settings = Settings.load(**{k: v for k, v in vars(args).items() if k in _FIELDS and v is not None})
    setup_logging(args.cmd, settings.log_level, settings.log_json)
    if args.cmd == "up":
        from .supervisor import Supervisor

        # `up` has no --metrics-port flag: only the environment chooses one.
        return Supervisor(settings, generators=args.generators, nats_port=args.nats_port,
                          external_nats=args.nats_url is not None,
                          metrics_port_chosen=f"{ENV_PREFIX}METRICS_PORT" in os.environ,
                          nats_cluster=args.nats_cluster, forks=forks).run()
    if args.cmd == "generator":
        from generator.main import serve as serve_generator

        run(serve_generator(settings))
        return 0
    if args.cmd == "relay":
        from relay.main import serve as serve_relay

        run(serve_relay(settings))
        return 0
    if args.cmd == "provision":
        from .provisioner import Provisioner

        prov = Provisioner(settings).start()
        try:
            if args.watch:
                signal.signal(signal.SIGTERM, lambda *_: prov.stop())
                prov.wait()
        finally:
            prov.stop()
        print("tokenpipe's streams are provisioned", file=sys.stderr)
        return 0
    if args.cmd == "submit" and args.batch is not None:
        from .batchsubmit import relay_url, run_batch

        return run_batch(args.batch, url=relay_url(args.url, settings.data_dir), api_key=args.api_key,
                         endpoint=args.endpoint, output=args.output)
    if args.cmd == "submit":
        if args.prompt is None:
            raise InvalidRequest("submit: give a prompt, or --batch FILE", param="prompt")
        return asyncio.run(_submit(args, settings))
    if args.cmd == "bench":
        return _bench(args)
    if args.cmd in ("replay", "streams", "tail"):
        return asyncio.run(_view_streams(args, settings))
    raise AssertionError(args.cmd)


def _nats_config(args: argparse.Namespace, data: str) -> Path | None:
    """``tokenpipe nats``'s configuration file: authorization (``--auth``) and TLS, or None."""
    from tokenpipe.natsauth import TLSFiles
    from tokenpipe.natsconfig import server_config, write_server_config

    tls = TLSFiles(args.tls_cert, args.tls_key, args.tls_ca or "", args.tls_verify) if args.tls_cert else None
    path = Path(data) / "nats-server.conf"
    if args.auth:
        settings = Settings.load()
        return write_server_config(path, args.creds_dir or Path(settings.data_dir) / "creds", tls, settings)
    if tls is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(server_config(None, tls))
        return path
    return None


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from .loadgen import LoadConfig, run_load
    from .report import plot, summary_table
    from .stats import summarize

    fields = {f.name for f in dataclasses.fields(LoadConfig)}  # every one but seed is a flag of the same name
    cfg = LoadConfig(**{k: v for k, v in vars(args).items() if k in fields})
    console = Console()
    with Progress(console=console) as progress:
        records, wall = asyncio.run(run_load(cfg, progress))
    summary = summarize(records, wall)
    console.print(summary_table(summary, f"tokenpipe bench — {cfg.api} API, "
                                + (f"{cfg.rate} req/s" if cfg.rate else f"concurrency {cfg.concurrency}")))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"config": vars(cfg), "summary": summary,
                                                   "records": [dataclasses.asdict(r) for r in records]}, indent=1))
    if args.plot:
        plot(records, args.plot, f"{cfg.api}, {summary['succeeded']} requests")
    return 0 if summary["failed"] == 0 else 1


async def _view_streams(args: argparse.Namespace, settings: Settings) -> int:
    from rich.console import Console

    from tokenpipe.bus import connect

    from . import streamview

    bus = await connect(settings, name=f"tokenpipe-{args.cmd}", role="admin")
    try:
        if args.cmd == "replay":
            return await streamview.replay(bus, args.id, speed=args.speed, as_json=args.jsonl, from_seq=args.from_seq,
                                           as_record=args.json)
        if args.cmd == "streams":
            return await streamview.list_streams(bus, limit=args.limit, console=Console())
        return await streamview.tail(bus, model=args.model, console=Console())
    finally:
        await bus.close()


async def _submit(args: argparse.Namespace, settings: Settings) -> int:
    from producer import Producer

    async with await Producer.connect(settings=settings) as producer:
        content: dict[str, Any] = {"prompt": args.prompt} if args.raw else {
            "messages": [{"role": "user", "content": args.prompt}]}
        handle = await producer.submit(args.model or settings.model, max_tokens=args.max_tokens,
                                       temperature=args.temperature, seed=args.seed, **content)
        try:
            async for batch in handle:
                if args.json:
                    print(json.dumps(batch.to_json()), flush=True)
                else:
                    print(batch.text, end="", flush=True)
                if batch.finish == "error":
                    print(f"\ntokenpipe: error: {batch.error}", file=sys.stderr)
                    return 1
        except asyncio.CancelledError:
            await handle.cancel()
            raise
        if not args.json:
            print()
    return 0
