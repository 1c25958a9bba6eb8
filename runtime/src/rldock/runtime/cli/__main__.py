"""`python -m rldock.runtime.cli`, as the `rldock` entry point."""

import sys

from rldock.runtime.cli import main

sys.exit(main())
