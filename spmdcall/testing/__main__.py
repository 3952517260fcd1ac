"""``python -m spmdcall.testing BACKEND [pytest options]``: the conformance suite against BACKEND."""

import sys

from spmdcall.testing import main

sys.exit(main())
