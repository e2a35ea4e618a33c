"""One-off measurement: APE's attention temperature on the cached keys a fusion keeps.

APE (Yang, Chen and Chen, ICLR 2025) corrects passages encoded apart, training-free, by dividing the
scores a query gives them by a temperature T (< 1 sharpens). Dividing every kept cached key of a chunk by
T does that for every later query (the recomputed rows, the question, the answer's tokens): a score is
linear in the key. Here the kept keys of each chunk are divided by T at every layer, after the chunk-shift
correction, on the default's layer path, at the same selection and budget: equal compute.

One ``cacheblend-rag eval`` run times full prefill once for every temperature: each temperature rides on a
spec that names one option at its default value (so the rows have their own labels and compute exactly
what ``cacheblend@R`` computes but for T):

    python tools/ape_temperature.py --data multinews-dev --chunk-tokens 128 --json /tmp/ape.json
"""

from __future__ import annotations

import sys

import torch

from cacheblend_rag.blend.cacheblend import CacheBlend
from cacheblend_rag.blend.shift import ChunkShift
from cacheblend_rag.cli import app

RATIO = 0.25  # what the default recomputes for short chunks
# the option a spec names at its default value -> the temperature its row runs at
TEMPERATURES = {
    "": 1.0,
    "probe_depth=0": 0.8,
    "chunk_rows=0": 0.9,
    "chunk_starts=0": 0.95,
    "score=contribution": 1.1,
}

_apply, _init, _shifts = ChunkShift.apply, ChunkShift.__init__, CacheBlend.shifts_chunks
_current = [1.0]  # the temperature of the method whose fusion builds the next ChunkShift


def _temperature(method: CacheBlend) -> float:
    named = [option for option in TEMPERATURES if option and option.split("=")[0] in method.model_fields_set]
    return TEMPERATURES[named[0]] if named else 1.0


def shifts_chunks(self: CacheBlend) -> bool:
    _current[0] = _temperature(self)  # the fusor asks this just before it builds the request's ChunkShift
    return _shifts(self)


def init(self: ChunkShift, *args, **kwargs) -> None:
    _init(self, *args, **kwargs)
    self.temperature = _current[0]


def apply(self: ChunkShift, keys: torch.Tensor, values: torch.Tensor, rows, fresh_k, fresh_v) -> None:
    _apply(self, keys, values, rows, fresh_k, fresh_v)
    if self.num_chunks and self.temperature != 1.0:
        # recomputed rows are written over these right after; the text between chunks keeps its keys
        inside = (self.region_chunk < self.num_chunks).to(keys.dtype)
        factor = 1.0 + (1.0 / self.temperature - 1.0) * inside
        keys[:, self.start : self.end] *= factor[None, :, None]


def main() -> None:
    CacheBlend.shifts_chunks = shifts_chunks  # type: ignore[method-assign]
    ChunkShift.__init__ = init  # type: ignore[method-assign]
    ChunkShift.apply = apply  # type: ignore[method-assign]
    specs = [f"cacheblend@ratio={RATIO}" + (f",{option}" if option else "") for option in TEMPERATURES]
    for spec, temperature in zip(specs, TEMPERATURES.values(), strict=True):
        print(f"{spec}: T = {temperature}", file=sys.stderr)
    app(args=["eval", "--methods", ",".join(specs), *sys.argv[1:]])


if __name__ == "__main__":
    main()
