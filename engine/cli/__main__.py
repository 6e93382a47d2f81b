"""``python -m engine.cli ...``."""

import sys

from .main import main

sys.exit(main())
