"""``python -m sftpack.cli``: the same as the ``sftpack`` command."""

import sys

from . import main

sys.exit(main())
