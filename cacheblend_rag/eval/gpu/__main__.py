"""``python -m cacheblend_rag.eval.gpu``: the accelerator check (see the package's docstring)."""

import sys

from .check import main

sys.exit(main())
