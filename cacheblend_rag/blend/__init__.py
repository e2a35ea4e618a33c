"""Position-independent caching: PIC methods, the fusor and the loading controller."""

from .budget import AdaptiveBudget, CoverBudget, FixedBudget, MarginBudget
from .budget_choice import BudgetChoice
from .cacheblend import CacheBlend, CacheBlendHKVD
from .controller import Decision, LoadingController, Profile
from .fusor import FusionResult, Fusor
from .methods import (
    Epic,
    FullRecompute,
    FullReuse,
    PrefixCache,
    RecomputeMethod,
    Reuse,
    available_methods,
    get_method,
    method_class,
    register_method,
)
from .plan import FusionPlan, LayerState
from .segments import ChunkKV, ChunkKVSource, DirectLayerKV, LayerKVProvider, Segment
from .spec import MethodSpec, ResolvedMethod, parse_method, resolve_method, reuse_of, split_specs

__all__ = [
    "AdaptiveBudget",
    "BudgetChoice",
    "CacheBlend",
    "CacheBlendHKVD",
    "ChunkKV",
    "ChunkKVSource",
    "CoverBudget",
    "Decision",
    "DirectLayerKV",
    "Epic",
    "FixedBudget",
    "FullRecompute",
    "FullReuse",
    "FusionPlan",
    "FusionResult",
    "Fusor",
    "LayerKVProvider",
    "LayerState",
    "LoadingController",
    "MarginBudget",
    "MethodSpec",
    "PrefixCache",
    "Profile",
    "RecomputeMethod",
    "ResolvedMethod",
    "Reuse",
    "Segment",
    "available_methods",
    "get_method",
    "method_class",
    "parse_method",
    "register_method",
    "resolve_method",
    "reuse_of",
    "split_specs",
]
