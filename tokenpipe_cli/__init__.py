"""The composition root: the ``tokenpipe`` command, ``tokenpipe up``'s supervisor, the process
launcher and the load generator behind ``tokenpipe bench``.

The only package that imports every role (generator, relay, producer); the core package
``tokenpipe`` and the roles never import it.
"""

from .cli import main

__all__ = ["main"]
