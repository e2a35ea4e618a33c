"""Grammar-constrained decoding of JSON: every sampled token keeps the output a prefix of valid JSON.

A :class:`JsonConstraint` is built once from a JSON schema (or ``"json_mode"``: any JSON object) and put
into :class:`~cacheblend_rag.engine.sampling.SamplingParams`. Each request then gets its own
:class:`ConstraintState` (the matcher): :meth:`ConstraintState.mask` sets the logits of tokens the grammar
does not allow to -inf before sampling (greedy or sampled alike), :meth:`ConstraintState.accept` advances
it after. EOS is allowed only once the JSON is complete, and a complete JSON ends generation (the engine
stops at once instead of spending a step on the forced EOS).

Closing within the token budget: a small model can loop inside a string or a list until its budget runs
out, leaving the JSON unfinished. The matcher therefore keeps an estimate of how many tokens the shortest
way to finish the JSON takes (by playing a closing policy on a copy of itself); once the remaining budget
gets down to that, it narrows the model's choices, step by step, to the first non-empty tier of: tokens
made of ``"``, ``]`` and ``}`` only (close what is open), short value starts (digits, ``"``, ``[``, ``{``,
``null``/``true``/``false``), separators towards a required key (``,``, ``:``), and else whatever the
grammar allows (an enum value or a key name the grammar dictates). The model chooses within the tier
while there is slack; once there is none, only the policy's own next token is allowed, so the JSON
completes inside the budget whenever the budget leaves room for the closing sequence at all.

The matcher is llguidance (chosen by measurement, see docs/structured_output.md). JSON is generated
compact (``", "`` and ``": "`` separators, no other whitespace): a small model cannot wander off into
whitespace, and every output parses the same way. Schema features the library cannot enforce (``not``,
``uniqueItems``, ``if``/``then``, external ``$ref``, look-around in ``pattern``...) raise
:class:`~cacheblend_rag.errors.StructuredOutputError` when the constraint is built, naming them.
"""

from __future__ import annotations

import copy
import functools
import json
import operator
import sys
import threading
import types
import weakref
from collections.abc import Collection, Mapping
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import numpy as np
import torch
from typing_extensions import is_typeddict  # typing's misses typing_extensions TypedDicts before 3.13

from ..errors import StructuredOutputError

JSON_MODE = "json_mode"
# compact JSON with the separators models are used to seeing
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_BIT_SHIFTS = np.arange(32, dtype=np.uint32)
CLOSE_MARGIN = 2  # tokens of slack kept beyond the estimated closing length
MAX_CLOSING_STEPS = 512  # a closing estimate that does not finish within this is treated as "close now"

_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple, _Vocab]] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def schema_of(obj: Any) -> dict[str, Any]:
    """The JSON schema of a Pydantic model class (``pydantic.v1`` models too), a TypedDict class, or a
    JSON schema dict (copied)."""
    if isinstance(obj, Mapping):
        if not all(isinstance(key, str) for key in obj):
            raise StructuredOutputError("a JSON schema must be a dict with string keys")
        return copy.deepcopy(dict(obj))
    from pydantic import BaseModel, TypeAdapter

    if isinstance(obj, type) and issubclass(obj, BaseModel):
        return obj.model_json_schema()
    if isinstance(obj, type) and is_typeddict(obj):
        return TypeAdapter(_pydantic_typeddicts(obj, set())).json_schema()
    from pydantic import v1 as pydantic_v1  # the Pydantic 1 API that Pydantic 2 still ships

    if isinstance(obj, type) and issubclass(obj, pydantic_v1.BaseModel):
        return obj.schema()
    raise StructuredOutputError(
        f"cannot make a JSON schema of {obj!r}: pass a Pydantic model class, a TypedDict class or a "
        "JSON schema dict"
    )


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _pydantic_typeddicts(tp: Any, seen: set[int]) -> Any:
    """``tp`` with every ``typing.TypedDict`` in it rebuilt as a ``typing_extensions.TypedDict``, which
    pydantic needs before Python 3.12 (same keys, types and required/optional keys)."""
    import typing_extensions

    if isinstance(tp, type) and is_typeddict(tp):
        if type(tp).__module__ != "typing" or sys.version_info >= (3, 12):
            return tp
        if id(tp) in seen:
            raise StructuredOutputError(
                f"{tp.__name__} refers to itself: on Python 3.11 use typing_extensions.TypedDict for it"
            )
        hints = get_type_hints(tp, include_extras=True)
        fields = {}
        for name, hint in hints.items():
            hint = _pydantic_typeddicts(hint, seen | {id(tp)})
            bare = get_origin(hint) in (typing_extensions.NotRequired, typing_extensions.Required)
            optional = name in tp.__optional_keys__ and not bare
            fields[name] = typing_extensions.NotRequired[hint] if optional else hint
        rebuilt = typing_extensions.TypedDict(tp.__name__, fields)
        rebuilt.__doc__ = tp.__doc__
        return rebuilt
    args = get_args(tp)
    if not args or get_origin(tp) is Literal:
        return tp
    new = tuple(_pydantic_typeddicts(arg, seen) if not isinstance(arg, list) else arg for arg in args)
    if new == args:
        return tp
    if get_origin(tp) is Annotated:
        return Annotated[(new[0], *tp.__metadata__)]
    if isinstance(tp, types.UnionType):
        return functools.reduce(operator.or_, new)
    return tp.copy_with(new) if hasattr(tp, "copy_with") else get_origin(tp)[new]


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its properties and
    says nothing about others (what OpenAI's strict mode assumes): output valid for it is valid for the
    original, and a small model cannot wander off into keys nobody asked for."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = (
                [strict_schema(sub) for sub in out[key]]
                if isinstance(out[key], list)
                else strict_schema(out[key])
            )
    if "properties" in out and not {"additionalProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


class JsonConstraint:
    """Constrain generation to JSON valid against ``schema`` (a dict, Pydantic model or TypedDict class),
    or to any JSON object with ``"json_mode"``. With ``strict`` (default) objects get no keys beyond their
    listed properties unless the schema allows them (:func:`strict_schema`). Immutable and shareable
    across requests; raises :class:`StructuredOutputError` for a schema that cannot be enforced."""

    def __init__(
        self, schema: dict[str, Any] | type | Literal["json_mode"] = JSON_MODE, strict: bool = True
    ) -> None:
        llg = _llguidance()
        self.mode = "json_mode" if schema == JSON_MODE else "json_schema"
        self.schema = {"type": "object"} if self.mode == "json_mode" else schema_of(schema)
        self.strict = strict
        enforced = strict_schema(self.schema) if strict else self.schema
        self.enforced_schema: dict[str, Any] = enforced
        try:
            self.grammar = llg.LLMatcher.grammar_from_json_schema(enforced, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise StructuredOutputError(f"invalid JSON schema: {exc}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.grammar)
        if is_error:
            raise StructuredOutputError(f"unsupported JSON schema: {messages[0]}")

    def guidance_schema(self) -> dict[str, Any]:
        """The enforced schema with this module's JSON options written into it (llguidance's
        ``x-guidance`` key, where the schema's own settings win): any llguidance matcher compiles it to
        the same grammar, e.g. vLLM's ``guidance`` structured-output backend."""
        options = {**JSON_OPTIONS, **(self.enforced_schema.get("x-guidance") or {})}
        return {**self.enforced_schema, "x-guidance": options}

    @classmethod
    def json_mode(cls) -> JsonConstraint:
        """Any JSON object."""
        return cls(JSON_MODE)

    def start(
        self, tokenizer, eos_ids: Collection[int], vocab_size: int, max_tokens: int | None = None
    ) -> ConstraintState:
        """A fresh matcher for one request over ``tokenizer`` (a fast HF tokenizer) whose model emits
        ``vocab_size`` logits and ends with any of ``eos_ids``; with ``max_tokens`` (the request's token
        budget) it steers the JSON to completion before the budget runs out."""
        return ConstraintState(self, _vocab(tokenizer, eos_ids, vocab_size), max_tokens)

    def __repr__(self) -> str:
        if self.mode == "json_mode":
            return "JsonConstraint('json_mode')"
        return f"JsonConstraint({json.dumps(self.schema)[:80]})"


class ConstraintState:
    """One request's matcher. Not thread-safe (a request is decoded by one thread at a time)."""

    def __init__(self, constraint: JsonConstraint, vocab: _Vocab, max_tokens: int | None = None) -> None:
        llg = _llguidance()
        self.constraint = constraint
        self.vocab_size = vocab.size
        self.max_tokens = max_tokens
        self.accepted = 0
        self.closing = False  # the budget is running out: choices narrowed towards the end of the JSON
        self._vocab = vocab
        self._matcher = llg.LLMatcher(vocab.ll_tokenizer, constraint.grammar)
        if self._matcher.is_error():
            raise StructuredOutputError(f"unsupported JSON schema: {self._matcher.get_error()}")
        self._bitmask = np.zeros(vocab.words, dtype=np.int32)
        self._closing_cost = self._cost_to_close() if max_tokens is not None else 0
        self._checked_at = 0

    @property
    def complete(self) -> bool:
        """The output so far is a complete JSON value (EOS is allowed)."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but EOS may follow: generation must end."""
        return self._matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next."""
        return self._vocab.unpack(self._allowed(self._matcher))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with every token not allowed next set to -inf (a new tensor): what the grammar
        forbids, and once the budget runs low whatever does not lead to the end of the JSON."""
        words = self._allowed(self._matcher)
        if not words.any():
            raise StructuredOutputError("constrained decoding failed: the grammar allows no next token")
        if self._must_close():
            words = self._vocab.closing_choices(words, self._matcher.is_accepting())
            # The model picks within the closing tier, and its pick may take longer than the policy's
            # (an opening quote where the policy closes a list): once no slack is left, only the
            # policy's own token, whose path is exactly the estimated length, keeps the JSON finishing.
            if self._cost_to_close() >= self.max_tokens - self.accepted:
                words = self._vocab.only(self._vocab.pick(words))
        return logits.masked_fill(~self._vocab.unpack(words).to(logits.device), float("-inf"))

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; returns True when the output is complete and nothing but EOS may
        follow (generation must end). A token the grammar does not allow raises."""
        if not self._matcher.consume_token(int(token)):
            raise StructuredOutputError(
                f"token {token} violates the JSON constraint: {self._matcher.get_error() or 'not allowed'}"
            )
        self.accepted += 1
        return self._matcher.is_stopped()

    def _allowed(self, matcher) -> np.ndarray:
        """The allowed tokens as a bitmask (int32 words, bit b of word w = token 32w+b)."""
        matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if matcher.is_error():
            raise StructuredOutputError(f"constrained decoding failed: {matcher.get_error()}")
        return self._bitmask.copy()

    def _must_close(self) -> bool:
        """Whether the remaining budget is down to what finishing the JSON takes (then it stays so)."""
        if self.max_tokens is None or self.closing:
            return self.closing
        remaining = self.max_tokens - self.accepted
        # refreshed when the budget gets near the estimate, and every few tokens before that (the model
        # may have opened more structure meanwhile)
        if remaining <= self._closing_cost + CLOSE_MARGIN + 16 or self.accepted - self._checked_at >= 8:
            self._closing_cost, self._checked_at = self._cost_to_close(), self.accepted
        self.closing = remaining <= self._closing_cost + CLOSE_MARGIN
        return self.closing

    def _cost_to_close(self) -> int:
        """Tokens the closing policy takes to finish the JSON from here (played on a copy)."""
        matcher = self._matcher.deep_copy()
        for steps in range(MAX_CLOSING_STEPS):
            if matcher.is_stopped():
                return steps
            if matcher.is_accepting():  # complete; the closing policy allows only EOS now
                return steps + 1
            choices = self._vocab.closing_choices(self._allowed(matcher), False)
            if not choices.any() or not matcher.consume_token(self._vocab.pick(choices)):
                break
        return MAX_CLOSING_STEPS


class _Vocab:
    """What the matcher needs of one tokenizer: llguidance's view of it, and the token tiers of the
    closing policy as bitmasks in llguidance's layout."""

    def __init__(self, tokenizer, eos_ids: Collection[int], size: int) -> None:
        llg = _llguidance()
        self.size = size
        self.words = (size + 31) // 32
        self.ll_tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=sorted(eos_ids) or None)
        known = min(size, len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in range(known)]) + [""] * (size - known)
        starts = {"null", "true", "false"}
        self.eos = self._pack([i in eos_ids for i in range(size)])
        self.tiers = [  # in order of preference; a space may lead (it ends a ": " or ", " separator)
            self._pack([bool(t.strip()) and set(t) <= set('"]} ') for t in texts]),  # close what is open
            self._pack(  # the shortest values: a number, an empty string, list or object, a literal
                [bool(t.strip()) and (set(t) <= set('0123456789-"[{ ') or t.strip() in starts) for t in texts]
            ),
            self._pack(
                [set(t) <= set(',: "') and bool(set(t) & set(",:")) for t in texts]
            ),  # to the next key
        ]
        # the closing policy's own pick within a tier: the longest token (closes or fills the most)
        self.rank = np.array([len(t) for t in texts], dtype=np.int64)

    def _pack(self, flags: list[bool]) -> np.ndarray:
        bits = np.zeros(self.words * 32, dtype=bool)
        bits[: len(flags)] = flags
        return np.packbits(bits, bitorder="little").view(np.int32)

    def unpack(self, words: np.ndarray) -> torch.Tensor:
        """Bool [size] of a bitmask."""
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.size]
        return torch.from_numpy(bits.astype(bool))

    def closing_choices(self, allowed: np.ndarray, complete: bool) -> np.ndarray:
        """EOS once the JSON is complete, else the first non-empty tier of the allowed tokens (all of them
        when no tier has one)."""
        for tier in (self.eos, *self.tiers) if complete else self.tiers:
            narrowed = allowed & tier
            if narrowed.any():
                return narrowed
        return allowed

    def only(self, token: int) -> np.ndarray:
        """The bitmask that allows ``token`` alone."""
        words = np.zeros(self.words, dtype=np.int32)
        words.view(np.uint32)[token // 32] = np.uint32(1) << np.uint32(token % 32)
        return words

    def pick(self, choices: np.ndarray) -> int:
        """The closing policy's token among ``choices`` (a non-empty bitmask)."""
        words = np.flatnonzero(choices)  # unpack only the words that hold a choice
        bits = (choices[words, None].view(np.uint32) >> _BIT_SHIFTS) & 1
        ids = (words[:, None] * 32 + _BIT_SHIFTS)[bits.astype(bool)]
        return int(ids[np.argmax(self.rank[ids])])


def masked(logits: torch.Tensor, state: ConstraintState | None) -> torch.Tensor:
    """``logits`` as a decode loop samples them: only the tokens that keep a constrained request's JSON
    valid (unchanged without a constraint)."""
    return logits if state is None else state.mask(logits)


def start_constraint(
    sampling, tokenizer, eos_ids: Collection[int], vocab_size: int, max_tokens: int
) -> ConstraintState | None:
    """The request's matcher when ``sampling`` carries a constraint, else None (the decode loops' hook)."""
    constraint = getattr(sampling, "constraint", None)
    return None if constraint is None else constraint.start(tokenizer, eos_ids, vocab_size, max_tokens)


def _vocab(tokenizer, eos_ids: Collection[int], size: int) -> _Vocab:
    """:class:`_Vocab` of ``tokenizer``, built once per (tokenizer, EOS ids, vocab size): about a second."""
    key = (tuple(sorted(eos_ids)), size)
    with _tokenizers_lock:
        built = _tokenizers.setdefault(tokenizer, {})
        if key not in built:
            built[key] = _Vocab(tokenizer, key[0], size)
        return built[key]


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise StructuredOutputError(
            "structured output needs llguidance: pip install llguidance (a dependency of cacheblend-rag)"
        ) from None
    return llguidance
