"""``python -m bench``: see ``bench/_cli.py``."""

import sys

from bench._cli import main

sys.exit(main())
