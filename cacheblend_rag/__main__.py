"""``python -m cacheblend_rag``: the ``cacheblend-rag`` command line."""

from .cli import app

app(prog_name="cacheblend-rag")
