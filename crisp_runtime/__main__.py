"""``python -m crisp_runtime verify DIR ...``: the ``crisp-pack`` command (crisp_runtime.pack.main)."""

import sys

from .pack import main

sys.exit(main())
