"""A script that leaves a batch scheduler running (a LangChain or LlamaIndex model it never closed) exits
with status 0: the scheduler's worker is stopped before the interpreter finalizes. A daemon thread still
inside torch at finalization is killed mid-unwind and aborts the process (``terminate called without an
active exception``, status 134)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The worker is deep in decoding when the script ends: three long sampled answers, one token read.
CHILD = """
import sys
from cacheblend_rag import CacheBlendRAG
from cacheblend_rag.engine import BatchScheduler, ChunkRef, GenerationRequest, SamplingParams

rag = CacheBlendRAG(sys.argv[1])
question = "The Unwinding author volunteered for which organisation?"
refs = [ChunkRef(c.token_ids, c.chunk_id) for c in rag.retrieve(question, 2)]
segments = rag.engine.rag_segments(question, refs, "cacheblend")
scheduler = BatchScheduler(rag.engine)
sampling = SamplingParams(max_tokens=400, temperature=1.5, seed=0)
handles = [scheduler.submit(GenerationRequest.of(segments, "cacheblend", sampling)) for _ in range(3)]
next(iter(handles[0]))
print("leaving while the worker decodes", flush=True)
"""


@pytest.mark.slow
def test_a_script_exits_cleanly_while_the_scheduler_decodes(shared_rag_store):
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(shared_rag_store)], capture_output=True, text=True, timeout=600
        )
        assert "leaving while the worker decodes" in done.stdout, done.stderr[-3000:]
        assert "terminate called" not in done.stderr, done.stderr[-3000:]
        assert done.returncode == 0, done.stderr[-3000:]


def test_a_scheduler_stopped_at_exit_ends_its_requests(model):
    """What the exit hook does to a scheduler: every request ends (cancelled), the worker is joined."""
    from cacheblend_rag.blend.segments import Segment
    from cacheblend_rag.engine import Engine, GenerationRequest, SamplingParams
    from cacheblend_rag.engine.scheduler import BatchScheduler
    from cacheblend_rag.errors import RequestCancelledError

    engine = Engine(model)
    scheduler = BatchScheduler(engine)
    prompt = [Segment.fresh(model.tokenizer.encode("Count from one to a thousand: one, two, three,"))]
    sampling = SamplingParams(max_tokens=300, temperature=1.5, seed=0)
    handles = [scheduler.submit(GenerationRequest.of(prompt, "full_recompute", sampling)) for _ in range(3)]
    next(iter(handles[0]))
    scheduler.stop_at_exit()
    assert not scheduler._thread.is_alive()
    assert all(handle.done() for handle in handles)
    cancelled = [isinstance(handle.future.exception(), RequestCancelledError) for handle in handles]
    assert any(cancelled), "the answers in progress are cancelled, not decoded to the end"
