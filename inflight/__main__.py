"""``python -m inflight ...`` runs the same command line as the ``inflight`` script."""

import sys

from inflight.cli import main

if __name__ == "__main__":  # guarded so that walking the package (a test does) does not run the CLI
    sys.exit(main())
