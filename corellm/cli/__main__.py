"""``python -m corellm.cli``."""

import sys

from corellm.cli.main import main

sys.exit(main())
