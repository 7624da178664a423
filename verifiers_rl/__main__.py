"""``python -m verifiers_rl`` is the ``verifiers-rl`` command."""

import sys

from verifiers_rl.cli.main import main

sys.exit(main())
