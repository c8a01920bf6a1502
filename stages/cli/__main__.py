"""``python -m stages.cli ...``: the ``stage`` command."""

import sys

from stages.cli import main

sys.exit(main())
