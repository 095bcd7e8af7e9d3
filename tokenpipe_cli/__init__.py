"""The composition root: the ``tokenpipe`` command, ``tokenpipe up``'s supervisor, the process
launcher and the load generator behind ``tokenpipe bench``.

The only package that imports every role (generator, relay, producer); the core package
``tokenpipe`` and the roles never import it.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The ``tokenpipe`` command (``argv``: its arguments; default ``sys.argv[1:]``).

    ``tokenpipe up`` starts its fork server here, before the command imports anything of its own: the fork
    server's import of torch and the engine is what a start waits for, and the command's own imports took
    0.65 s of it on the 2-core AVX2 machine (a second start then took 5.1-5.9 s after nats-server was ready,
    issue 49). The supervisor uses it, or stops it if no generator is forked (``tokenpipe_cli.supervisor``)."""
    args = sys.argv[1:] if argv is None else argv
    forks = None
    if args[:1] == ["up"] and not {"-h", "--help"} & set(args):
        from .forkserver import PRELOAD, ForkServer

        # Not without what it imports (an install without the `all` extra): `up` then says which extra is missing.
        if all(importlib.util.find_spec(m.split(".")[0]) is not None for m in PRELOAD):
            forks = ForkServer()
    from .cli import main as run

    return run(argv, forks=forks)
