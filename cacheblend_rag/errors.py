"""Exceptions raised by cacheblend-rag. Each names the problem and, where possible, the fix."""


class CacheBlendError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelNotFoundError(CacheBlendError):
    """No usable model at the given name or path."""


class UnsupportedModelError(CacheBlendError):
    """The model exists but its architecture is not one the layer-wise runtime implements."""


class ContextLengthError(CacheBlendError, ValueError):
    """A prompt (or prompt plus generation budget) does not fit the model's context window."""


class MaxTokensError(ContextLengthError):
    """``max_tokens``, asked for outright, does not fit the context beside the prompt."""


class FusionInputError(CacheBlendError, ValueError):
    """The segments handed to the fusor are inconsistent (wrong KV shape, foreign model, empty...)."""


class StoreError(CacheBlendError):
    """The KV store or chunk store cannot serve a request (unwritable, foreign, corrupted beyond repair)."""


class IngestError(CacheBlendError, ValueError):
    """An input file cannot be ingested (missing, empty, binary, malformed)."""


class InvalidChunkIdError(CacheBlendError, ValueError):
    """A chunk id given by a caller is malformed (chunk ids are 32 lowercase hex characters)."""


class ChunkNotFoundError(StoreError, KeyError):
    """A well-formed chunk id that the corpus does not hold."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class CorruptKVError(StoreError):
    """A stored chunk's KV failed its checksum when a layer was read; the entry has been removed.

    The caller recomputes the chunk (and may store it again) and retries the request.
    """

    def __init__(self, key: str, message: str, layer: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.layer = layer


class RemoteKVUnavailableError(CorruptKVError):
    """The remote KV tier went down while a chunk's layers were being read from it (nothing was removed).

    Handled like a corrupt chunk: the caller recomputes it and retries; the tier reports misses until it
    is back.
    """


class StructuredOutputError(CacheBlendError, ValueError):
    """A JSON schema the constrained decoder cannot enforce (the message names the feature), a token
    that violates the constraint, or an engine that cannot honour a constraint."""


class InvalidQueryError(CacheBlendError, ValueError):
    """A retrieval request is malformed (empty question, top_k out of range, empty text to add)."""


class EvalDataError(CacheBlendError, ValueError):
    """An evaluation data set or results file is missing, malformed or does not match the run."""


class MethodOptionError(CacheBlendError, ValueError):
    """An unknown method, or options a method does not take or whose values it refuses."""


class AdmissionError(CacheBlendError, ValueError):
    """A request can never be admitted by the batch scheduler (alone it exceeds the batch KV budget)."""


class RequestCancelledError(CacheBlendError):
    """A request was cancelled (e.g. its client went away) before it finished; its slot was freed."""


class EngineClosedError(CacheBlendError, RuntimeError):
    """The engine or frontend a request was sent to is closed (or shutting down): it takes no more
    requests. A server answers it as draining."""


class SchedulerClosedError(EngineClosedError):
    """The batch scheduler is closed: it takes no more requests (those submitted before are served)."""
