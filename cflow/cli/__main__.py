"""`python -m cflow.cli ARGS` is `cflowc ARGS`."""

import sys

from . import cflowc_main

sys.exit(cflowc_main())
