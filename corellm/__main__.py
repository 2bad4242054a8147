import sys

from corellm.cli.commands import main

sys.exit(main())
