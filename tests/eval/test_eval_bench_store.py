"""The loading benchmark helper on a tiny workload (the full 6 x 512 run is `cacheblend-rag bench`'s)."""

from __future__ import annotations

import json

from cacheblend_rag.eval.bench.store import LoadingResult, bench_loading


def test_bench_loading_reports_every_measurement(model, tmp_path):
    result = bench_loading(model, num_chunks=2, tokens=24, work_dir=tmp_path, repeats=1)
    assert LoadingResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert result.tokens == 48 and result.full_prefill_s > 0
    assert set(result.load_all_layers_s) == {"ram", "disk_warm", "disk_cold"}
    assert all(seconds > 0 for seconds in result.load_all_layers_s.values())
    for tier in ("ram", "disk_cold"):
        off, on = result.pipelined[tier]["prefetch_off"], result.pipelined[tier]["prefetch_on"]
        assert off["hidden_fraction"] == 0.0 and off["layers"] == on["layers"] == model.num_layers
        assert 0.0 <= on["hidden_fraction"] <= 1.0
    assert not list(tmp_path.iterdir())
