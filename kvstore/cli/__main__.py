"""`python -m kvstore.cli ...` is the `kvstore` command."""

import sys

from kvstore.cli.main import main

sys.exit(main())
