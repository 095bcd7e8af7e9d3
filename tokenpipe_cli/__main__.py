"""``python -m tokenpipe_cli``: the ``tokenpipe`` command with this interpreter (how roles are spawned)."""

import sys

from .cli import main

sys.exit(main())
