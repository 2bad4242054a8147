import sys

from corellm.cli import main

sys.exit(main())
