"""``python -m gateway.cli``: the ``satisfice`` command without its script (tests and
benchmarks start gateways this way, with the interpreter they run under)."""

import sys

from gateway.cli import main

sys.exit(main())
