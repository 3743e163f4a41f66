#!/usr/bin/env python3
"""The kvstore daemon's entry point: `python server.py [flags]` == `kvstore serve [flags]`."""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
