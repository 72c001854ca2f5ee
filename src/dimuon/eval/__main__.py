"""``python -m dimuon.eval``: the same as ``dimuon eval``."""

import sys

from dimuon.eval.run import main

sys.exit(main())
