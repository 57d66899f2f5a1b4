"""`python -m raygpt ...` is the `raygpt` command (see raygpt.cli)."""

import sys

from raygpt.cli import main

sys.exit(main())
