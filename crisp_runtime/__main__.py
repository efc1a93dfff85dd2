"""``python -m crisp_runtime verify DIR ...``: the ``crisp-pack`` command (crisp_runtime.storage.pack.main)."""

import sys

from crisp_runtime.storage.pack import main

sys.exit(main())
