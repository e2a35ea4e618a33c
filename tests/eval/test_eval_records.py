"""Eval results files read through typed records: a misspelt or missing key fails at once, naming it, and
every published results file reads and writes back byte for byte."""

from __future__ import annotations

import copy
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from cacheblend_rag.errors import EvalDataError
from cacheblend_rag.eval.records import (
    EvalResults,
    MethodRecord,
    MethodRow,
    RetrievedRecord,
    load_results,
    read_results,
)

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = sorted((ROOT / "docs" / "results").glob("*.json")) + sorted(
    (ROOT / "docs" / "notes" / "results").glob("*.json")
)
SMALL = ROOT / "docs" / "results" / "eval-musique-heldout-512-rowblocks.json"


def is_eval_results(path: Path) -> bool:
    """eval and tune write eval results; the bench and the GPU check write files of their own."""
    return path.name.startswith(("eval-", "tune-"))


@pytest.fixture(scope="module")
def small() -> dict:
    return json.loads(SMALL.read_text())


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: p.name)
def test_every_published_results_file_reads_and_writes_back_the_same(path):
    text = path.read_text()
    if not is_eval_results(path):
        with pytest.raises(EvalDataError, match="not a cacheblend-rag eval results file"):
            load_results(path)
        return
    results = load_results(path)
    assert results.to_dict() == json.loads(text)
    assert json.dumps(results.to_dict(), indent=1) + "\n" == text  # key order kept: resumes rewrite it as is
    assert results.summarized().methods and all(case.methods for case in results.cases)


def test_a_misspelt_key_is_refused_by_name(small):
    record = dict(small["cases"][0]["methods"]["full_recompute"])
    record["chunk_recompute_ration"] = record.pop("chunk_recompute_ratio")
    with pytest.raises(EvalDataError, match="MethodRecord has no field 'chunk_recompute_ration'"):
        MethodRecord.from_dict(record)
    row = {**small["summary"]["methods"]["full_recompute"], "first_token_agreemnt": 1.0}
    with pytest.raises(EvalDataError, match="no field 'first_token_agreemnt'"):
        MethodRow.from_dict(row)


def test_a_missing_required_key_is_refused_by_name(small):
    record = dict(small["cases"][0]["methods"]["full_recompute"])
    del record["ttft_s"]
    with pytest.raises(EvalDataError, match="MethodRecord lacks field 'ttft_s'"):
        MethodRecord.from_dict(record)
    chunk = dict(small["cases"][0]["retrieved"][0])
    del chunk["score"]  # None is a value here (chunks in document order), never left out
    with pytest.raises(EvalDataError, match="lacks field 'score'"):
        RetrievedRecord.from_dict(chunk)


def test_a_bad_key_deep_in_a_file_names_where_it_is(small, tmp_path):
    data = copy.deepcopy(small)
    data["cases"][1]["methods"]["cacheblend@0.15"]["kl_first_tokn"] = 0.0
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    with pytest.raises(EvalDataError) as raised:
        load_results(path)
    message = str(raised.value)
    assert str(path) in message and "cases[1]" in message and "'cacheblend@0.15'" in message
    assert "kl_first_tokn" in message
    data = copy.deepcopy(small)
    data["config"]["top-k"] = data["config"].pop("top_k")
    with pytest.raises(EvalDataError, match="RunConfig has no field 'top-k'"):
        read_results(data, "edited")


def test_older_files_lack_optional_keys_and_keep_lacking_them(small):
    record = dict(small["cases"][0]["methods"]["full_recompute"])
    for key in ("first_token_margin", "reference_margin", "options", "budget", "agreement_rouge_l"):
        record.pop(key, None)
    read = MethodRecord.from_dict(record)
    assert read.reference_margin is None and read.first_token_margin is None
    assert read.to_dict() == record  # what a file lacks is not written back as null
    data = copy.deepcopy(small)
    for key in ("engine", "methods_revision", "kv_dtypes", "decisive_margin"):
        data["config"].pop(key, None)
    config = EvalResults.from_dict(data).config
    assert (config.engine_kind, config.revision, config.codecs) == ("torch", 1, [config.kv_dtype])


def test_a_record_read_keeps_its_key_order_and_one_made_here_has_its_fields_order(small):
    record = small["cases"][0]["methods"]["full_recompute"]
    shuffled = dict(reversed(list(record.items())))
    read = MethodRecord.from_dict(shuffled)
    assert list(read.to_dict()) == list(shuffled) and read == MethodRecord.from_dict(record)
    made = replace(read, key_order=())
    assert list(made.to_dict()) == [f.name for f in fields(MethodRecord) if f.name in record]
    fresh = RetrievedRecord(context=0, chunk=1, tokens=12, score=None)
    assert list(fresh.to_dict().items()) == [("context", 0), ("chunk", 1), ("tokens", 12), ("score", None)]
