"""What one results column is: a method spec, optionally with the chunk context its chunk KV is
precomputed behind (``none:cacheblend@0.15`` measures chunks prefilled alone), and how a list of them is
expanded from ``--methods`` and ``--ratios``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..blend.spec import MethodSpec, parse_method
from ..engine.fidelity import REFERENCE

CHUNK_CONTEXTS = ("neutral", "none")


@dataclass(frozen=True)
class Variant:
    """One column of eval results: ``label`` (``cacheblend@0.15``, ``none:epic``), the method spec and
    the chunk context (None: the run's own, set by ``--chunk-context``)."""

    label: str
    spec: MethodSpec
    context: str | None = None
    kv_dtype: str | None = None  # the chunk KV codec (None: the run's own); labelled ``int8:...``

    @property
    def options(self) -> dict:
        return dict(self.spec.options)


def parse_variant(text: str) -> Variant:
    """``[context:]spec``: ``cacheblend_hkvd@ratio=0.15,signal=v``, ``none:full_reuse``."""
    head, colon, rest = text.strip().partition(":")
    if colon and head in CHUNK_CONTEXTS:
        spec = parse_method(rest)
        return Variant(f"{head}:{spec.label}", spec, head)
    if colon:
        raise ValueError(
            f"{text!r}: unknown chunk context {head!r} before ':' (use {' or '.join(CHUNK_CONTEXTS)})"
        )
    spec = parse_method(text)
    return Variant(spec.label, spec)


def method_variants(
    methods: Sequence[str], ratios: Sequence[float], kv_dtypes: Sequence[str] = ()
) -> list[Variant]:
    """Expand ``methods`` into variants, the reference first: a plain method with a recompute ratio (e.g.
    ``cacheblend`` or ``none:cacheblend``) once per ratio of ``ratios``; with ``kv_dtypes`` (codecs, the
    first the run's own), every variant but the reference once more per other codec, labelled
    ``int8:cacheblend@0.15`` (the reference, full prefill, reuses no KV: computed once per case)."""
    variants: list[Variant] = []
    for text in methods:
        variant = parse_variant(text)
        if not takes_ratio(variant.spec):
            variants.append(variant)
            continue
        for ratio in ratios:
            spec = run_spec(variant.spec, ratio)
            prefix = f"{variant.context}:" if variant.context else ""
            variants.append(Variant(prefix + spec.label, spec, variant.context))
    variants = list({v.label: v for v in variants}.values())
    for codec in kv_dtypes[1:]:
        variants += [
            Variant(f"{codec}:{v.label}", v.spec, v.context, codec)
            for v in list(variants)
            if v.label != REFERENCE and v.kv_dtype is None
        ]
    if not any(v.label == REFERENCE for v in variants):
        variants.insert(0, Variant(REFERENCE, MethodSpec(REFERENCE, REFERENCE)))
    return sorted(variants, key=lambda v: v.label != REFERENCE)


def takes_ratio(spec: MethodSpec) -> bool:
    """Whether a run sets ``spec``'s ratio: a plain method with a ratio option (a spec with options runs
    as it is written)."""
    return not spec.options and spec.method_class.ratio_option is not None


def run_spec(spec: MethodSpec, ratio: float) -> MethodSpec:
    """The spec a run of ``spec`` at ``ratio`` uses, and labels its results with."""
    return spec.with_ratio(ratio, where_taken=True) if takes_ratio(spec) else spec


def method_specs(methods: Sequence[str], ratios: Sequence[float]) -> list[MethodSpec]:
    """The method specs of :func:`method_variants` (the reference first)."""
    return [v.spec for v in method_variants(methods, ratios)]
