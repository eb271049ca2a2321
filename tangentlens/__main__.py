"""``python -m tangentlens``: the same as the ``tangentlens`` command."""

import sys

from .cli.commands import main

sys.exit(main())
