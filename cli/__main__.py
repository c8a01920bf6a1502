"""``python -m cli ...``: the ``stage`` command."""

import sys

from cli import main

sys.exit(main())
