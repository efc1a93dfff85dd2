"""``python -m crisp_tools.profiler``: the ``crisp-profile`` command."""

import sys

from .cli import main

sys.exit(main())
