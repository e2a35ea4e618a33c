"""Request bounds checked before any model loads, worded alike on every entry point: top_k 0 is refused
(never "the default"), a ratio a method does not take is refused by name, and the CLI names bad input
before loading a model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cacheblend_rag.engine import Engine
from cacheblend_rag.engine.bounds import check_request
from cacheblend_rag.errors import InvalidQueryError, MethodOptionError
from cacheblend_rag.frontend import GenerationOptions
from cacheblend_rag.rag import CacheBlendRAG


def run_cli(*args: object) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "cacheblend_rag", *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


TOP_K = "top_k must be an integer between 1 and 1000, got"
NO_RATIO = "method 'full_recompute' takes no ratio (ratio 0.3 given)"


@pytest.mark.parametrize("top_k", [0, -1, 1001])
def test_top_k_out_of_range_is_refused_zero_included(top_k):
    with pytest.raises(InvalidQueryError, match=f"{TOP_K} {top_k}"):
        check_request("cacheblend", top_k=top_k)


def test_a_ratio_the_method_does_not_take_is_refused_by_name():
    with pytest.raises(MethodOptionError, match=re.escape(NO_RATIO)):
        check_request("full_recompute", ratio=0.3)
    assert check_request("cacheblend", ratio=0.3).label == "cacheblend@0.3"
    with pytest.raises(ValueError, match="method 'full_reuse' takes no ratio"):  # pydantic's wrapper
        GenerationOptions(method="full_reuse", ratio=0.3)
    with pytest.raises(ValueError, match="the question is empty"):
        check_request("cacheblend", question="  ")
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        check_request("cacheblend", max_tokens=0)


def test_cacheblend_rag_refuses_top_k_zero_and_an_unused_ratio(model, rag_store):
    rag = CacheBlendRAG(rag_store, engine=Engine(model, store=rag_store / "kv-bounds"))
    with pytest.raises(InvalidQueryError, match=f"{TOP_K} 0"):
        rag.query("Who wrote The Lamp Room?", top_k=0)
    with pytest.raises(InvalidQueryError, match=f"{TOP_K} 0"):
        rag.retrieve("Who wrote The Lamp Room?", top_k=0)
    with pytest.raises(MethodOptionError, match=re.escape(NO_RATIO)):
        rag.query("Who wrote The Lamp Room?", method="full_recompute", ratio=0.3)
    assert len(rag.retrieve("Who wrote The Lamp Room?", top_k=1)) == 1
    rag.engine.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["", "--top-k", "2"], "the question is empty"),
        (["Who?", "--top-k", "0"], f"{TOP_K} 0"),
        (["Who?", "--method", "nonsense"], "unknown method 'nonsense'"),
        (["Who?", "--method", "full_recompute", "--ratio", "0.3"], NO_RATIO),
    ],
)
def test_cli_names_bad_input_before_loading_a_model(sample_store, tmp_path, args, message):
    # a model that does not exist: were it loaded first, its error would come instead
    result = run_cli("query", "--corpus", sample_store, "--model", tmp_path / "no-model", *args)
    assert result.returncode == 2, result.stderr
    assert message in " ".join(result.stderr.split())
    assert "no-model" not in result.stderr and "Loading weights" not in result.stderr
