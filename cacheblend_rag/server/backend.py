"""The server's one link to the core: everything else in ``cacheblend_rag.server`` speaks HTTP and OpenAI.

A request's prompt goes through the same :class:`~cacheblend_rag.frontend.PromptFrontend` the LangChain
and LlamaIndex integrations use: stored chunks pasted into the prompt are recognised (and ``chunk_ids`` /
``documents`` located) and become cached segments. A chat whose content parts name stored chunks is laid out
structurally instead (:meth:`~cacheblend_rag.engine.prompt.PromptBuilder.chat_parts`): each chunk's stored
token ids where it is named, no text searched. Every engine answers through the frontend's stream
handle (:class:`~cacheblend_rag.engine.StreamHandle`), from the engine's ``submit``: the PyTorch engine's
requests go to its :class:`~cacheblend_rag.engine.BatchScheduler`, so concurrent requests are decoded
together; vLLM batches the vLLM engine's. A request whose client goes away is cancelled through
its handle (``cancel()``): its row leaves the scheduler's batch at once, vLLM aborts it at its next
token. Core exceptions a client caused become :class:`~cacheblend_rag.server.errors.APIError`; a closed
engine or scheduler (:class:`~cacheblend_rag.errors.EngineClosedError`) answers as draining.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..config import Config
from ..engine import BatchScheduler, ChunkRef, GenerationResult, PromptPart, StreamHandle
from ..engine.session import Session
from ..errors import (
    AdmissionError,
    ChunkNotFoundError,
    ContextLengthError,
    EngineClosedError,
    InvalidChunkIdError,
    MaxTokensError,
    MethodOptionError,
    RequestCancelledError,
    StructuredOutputError,
)
from ..frontend import DocumentRef, PromptFrontend, TextRequest, constraint_of, text_request
from ..settings import get_settings
from .errors import APIError, draining_error
from .protocol import Answer, ChunkPart, GenerationSpec

log = logging.getLogger(__name__)


class RunningRequest:
    """A submitted request. :meth:`events` yields its text as generated (blocking: run it on a thread of
    its own, one consumer); :meth:`result` waits for the :class:`Answer`; :meth:`cancel` stops it (from
    any thread).

    ``handle``: the engine's stream handle. Cancelling sets a flag the token loop checks, and cancels the
    handle (which stops the request in the engine).
    """

    def __init__(
        self, handle: StreamHandle[GenerationResult], engine_kind: str, received: float, param: str
    ) -> None:
        self.received = received
        self.engine_kind = engine_kind
        self._handle = handle
        self._events = iter(handle)
        self._param = param
        self._cancelled = threading.Event()
        self._first: Any = None

    def prefetch(self) -> RunningRequest:
        """Wait for the first token, so that a request the engine refuses when it first steps it fails
        before any reply is sent (vLLM checks a request then)."""
        with _client_errors(self._param):
            self._first = next(self._events, None)
        return self

    def events(self) -> Iterator[str]:
        with _client_errors(self._param):
            first, self._first = self._first, None
            if first is not None:
                yield first.text
            for event in self._events:
                if self._cancelled.is_set():
                    raise RequestCancelledError("the request was cancelled")
                yield event.text

    def result(self) -> Answer:
        for _ in self.events():
            pass
        with _client_errors(self._param):
            return self._answer(self._handle.result())

    def cancel(self) -> None:
        self._cancelled.set()
        if self._handle.cancel():
            log.info("a request was cancelled: its client went away")

    def _answer(self, result: GenerationResult) -> Answer:
        done = time.perf_counter()
        details = {
            "method": result.method,
            "method_options": result.method_options,
            "controller": result.controller,
            # what the method chose for this request's chunks (or null)
            "budget": result.budget.to_dict() if result.budget is not None else None,
            # from the server's receipt of the request, and its parts (docs/accounting.md): laying the
            # prompt out (recognition, KV lookups, chunk KV computed for it), queueing, the fusion
            "ttft_s": result.ttft_s,
            "prompt_s": result.prompt_s,
            "queue_s": result.queue_s,
            "fusion_s": result.fusion_s,
            "fusion_path": result.fusion_path,
            "total_s": done - self.received,
            "recompute_ratio": result.recompute_ratio,
            "reused_tokens": result.reused_tokens,
            "computed_tokens": result.computed_tokens,
            "cached_tokens": result.cached_tokens,  # read from a cache: the two below
            "cache_read_exact_tokens": result.cache_read_exact_tokens,
            "cache_read_blended_tokens": result.cache_read_blended_tokens,
            "kv_computed_tokens": result.kv_computed_tokens,
            "chunk_ids": list(result.chunk_ids),
            "load_wait_s": result.load_wait_s,
            "engine": self.engine_kind,
        }
        return Answer(
            text=result.text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=len(result.token_ids),
            cached_tokens=result.cached_tokens,
            details=details,
        )


class EngineBackend:
    """The model, the corpus and the engine behind one server (see the module docstring).

    ``corpus_dir``: a corpus built by ``cacheblend-rag ingest``; ``model``: default the corpus's;
    ``engine_kind``: "torch" or "vllm" (default: the ``engine`` setting). ``served_name``: the model id
    clients name (default the model's name). ``config``: the values to serve with (default: the
    process's settings, ``CACHEBLEND_*``): the engine's, the batch scheduler's, the default method.
    """

    def __init__(
        self,
        corpus_dir: str | Path,
        model: str | None = None,
        served_name: str | None = None,
        engine_kind: str | None = None,
        config: Config | None = None,
    ) -> None:
        self.corpus_dir = Path(corpus_dir)
        self.config = get_settings() if config is None else config
        self.frontend = PromptFrontend(corpus_dir, model, engine_kind=engine_kind, config=self.config)
        session = self.frontend.session
        assert session is not None  # a frontend over a corpus has one
        self.session: Session = session  # the corpus and the engine, checked once to belong together
        self.engine = session.engine
        # the engine's batch scheduler (PyTorch), started now; None where vLLM batches its own requests
        self.scheduler: BatchScheduler | None = self.engine.scheduler
        self.kind = "torch" if self.scheduler is not None else "vllm"
        if self.scheduler is not None:
            # the template's opening, computed here if no request computed it yet (a corpus just
            # ingested): else the first request would, and count it (docs/accounting.md)
            self.engine.warm_opening()
        self.model_id = served_name or self.frontend.model_name
        self.fingerprint = self.engine.model.fingerprint
        self.created = int(time.time())
        self._closed = False

    # -- requests ------------------------------------------------------------------------------------

    def start(self, spec: GenerationSpec, received: float) -> RunningRequest:
        """Build the request's segments (recognising stored chunks) and submit it. Blocking: chunk KV is
        looked up, and computed on a miss. Raises :class:`APIError` for a request that cannot be served."""
        if self._closed:
            raise draining_error()
        param = "messages" if spec.messages is not None else "prompt"
        request = self._text_request(spec, param, received)
        with _client_errors(param):
            running = RunningRequest(self.frontend.stream(request), self.kind, received, param)
            # the scheduler checks a request at submit; an engine batching its own (vLLM) when it first
            # steps it
            return running if self.scheduler is not None else running.prefetch()

    def _text_request(self, spec: GenerationSpec, param: str, received: float) -> TextRequest:
        documents = [DocumentRef(text, chunk_id) for text, chunk_id in spec.documents]
        with _client_errors("chunk_ids"):
            documents += self.frontend.chunk_documents(spec.chunk_ids) if spec.chunk_ids else []
        with _client_errors("response_format"):
            # json_object: any JSON object; json_schema: valid against the schema (strict unless false)
            constraint = constraint_of(spec.response_format)
        parts = self._chat_parts(spec.messages) if spec.messages is not None else []
        with _client_errors(param):
            text = spec.prompt
            if spec.messages is not None and not parts:
                text = self.frontend.render_chat(spec.messages)
            return text_request(
                text or "",
                documents,
                method=spec.method or self.config.method,
                ratio=spec.ratio,
                max_tokens=spec.max_tokens,
                temperature=spec.temperature,
                top_p=spec.top_p,
                seed=spec.seed,
                stop=spec.stop,
                strict=spec.strict,
                constraint=constraint,
                parts=parts,
                arrived_at=received,
            )

    def _chat_parts(self, messages: list[dict[str, Any]]) -> list[PromptPart]:
        """A chat that names stored chunks (:class:`ChunkPart`) as prompt parts, each chunk's stored token
        ids where it is named (no text searched); [] for a chat of text only."""
        pieces = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
        refs: dict[str, ChunkRef] = {}
        for part in pieces:
            if isinstance(part, ChunkPart):
                with _client_errors("messages", chunks=part.where):
                    (refs[part.where],) = self.frontend.chunk_refs([part.chunk_id])
        if not refs:
            return []
        chat = [
            {**m, "content": [refs[p.where] if isinstance(p, ChunkPart) else p for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        with _client_errors("messages"):
            return self.engine.prompts.chat_parts(chat)

    # -- state ---------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What ``/v1/models`` tells about the model."""
        return {
            "engine": self.kind,
            "fingerprint": self.fingerprint,
            "context_window": self.engine.context_window,
            "corpus": str(self.corpus_dir),
        }

    def health(self) -> dict[str, Any]:
        """The scheduler's queue and counters, and the KV store's tiers and counters."""
        stats = self.engine.store.stats()
        counters = {k: v for k, v in stats["counters"].items() if k != "disk_layer_reads"}
        info: dict[str, Any] = {
            "model": self.model_id,
            **self.describe(),
            "kv_store": {
                "ram": stats["ram"],
                "disk": stats["disk"],
                "counters": counters,
                "remote": stats["remote"],
            },
        }
        if self.scheduler is not None:
            scheduler = self.scheduler
            info["scheduler"] = {
                "waiting": scheduler.waiting,
                "active": scheduler.active,
                "max_batch": scheduler.max_batch,
                **scheduler.stats.as_dict(),
            }
        return info

    def close(self) -> None:
        """Finish the requests already submitted (the engine's scheduler does), then release the engine,
        its KV store and the corpus."""
        if self._closed:
            return
        self._closed = True
        self.frontend.close()  # its session's engine (with the scheduler) and its hold on the corpus


@contextmanager
def _client_errors(param: str, chunks: str = "chunk_ids") -> Iterator[None]:
    """Core exceptions a request caused, as API errors naming the parameter at fault (``chunks``: the one
    naming the chunk ids looked up)."""
    try:
        yield
    except (APIError, RequestCancelledError):
        raise
    except EngineClosedError as exc:  # the scheduler, frontend or engine is shutting down
        raise draining_error() from exc
    except MaxTokensError as exc:
        raise APIError.bad_request(str(exc), "max_tokens", "context_length_exceeded") from exc
    except ContextLengthError as exc:
        raise APIError.bad_request(str(exc), param, "context_length_exceeded") from exc
    except AdmissionError as exc:
        raise APIError.bad_request(str(exc), "max_tokens", "request_too_large") from exc
    except ChunkNotFoundError as exc:
        raise APIError.bad_request(str(exc), chunks, "chunk_not_found") from exc
    except InvalidChunkIdError as exc:
        raise APIError.bad_request(str(exc), chunks, "invalid_chunk_id") from exc
    except StructuredOutputError as exc:
        raise APIError.bad_request(str(exc), "response_format", "unsupported_schema") from exc
    except MethodOptionError as exc:  # an unknown method, or options it refuses
        raise APIError.bad_request(str(exc), "method") from exc
    except ValueError as exc:  # the core's bad-input errors (empty prompt, invalid Unicode, bad option)
        raise APIError.bad_request(str(exc), param) from exc
