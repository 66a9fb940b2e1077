"""``python -m engine.serve [options]``: the same as ``rollout serve [options]``."""

import sys

from ._server import main

sys.exit(main())
