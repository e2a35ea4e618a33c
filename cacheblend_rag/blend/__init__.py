"""Position-independent caching: PIC methods, the fusor and the loading controller."""

from .fusor import FusionResult, Fusor
from .methods import (
    CacheBlend,
    Epic,
    FullRecompute,
    FullReuse,
    FusionPlan,
    LayerState,
    PrefixCache,
    RecomputeMethod,
    available_methods,
    get_method,
    register_method,
)
from .segments import ChunkKV, ChunkKVSource, DirectLayerKV, LayerKVProvider, Segment

__all__ = [
    "CacheBlend",
    "ChunkKV",
    "ChunkKVSource",
    "DirectLayerKV",
    "Epic",
    "FullRecompute",
    "FullReuse",
    "FusionPlan",
    "FusionResult",
    "Fusor",
    "LayerKVProvider",
    "LayerState",
    "PrefixCache",
    "RecomputeMethod",
    "Segment",
    "available_methods",
    "get_method",
    "register_method",
]
