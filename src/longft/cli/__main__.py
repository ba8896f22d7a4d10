"""`python -m longft.cli ...` runs the `longft` command without installing its console script."""

import sys

from longft.cli.main import main

sys.exit(main())
