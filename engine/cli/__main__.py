"""``python -m engine.cli [args]``: the same as ``rollout [args]``."""

import sys

from ._main import main

sys.exit(main())
