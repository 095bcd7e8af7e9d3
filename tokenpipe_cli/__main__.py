"""``python -m tokenpipe_cli``: the ``tokenpipe`` command with this interpreter (how roles are spawned)."""

import sys

from . import main

sys.exit(main())
