"""``python -m logitless``: the ``logitless`` command."""

import sys

from logitless.cli import main

sys.exit(main())
