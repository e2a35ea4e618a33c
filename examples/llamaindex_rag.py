"""LlamaIndex: a query engine over the sample corpus whose synthesizer hands the retrieved nodes to
CacheBlendLLM as segments, so their precomputed KV is blended in; then a stock RetrieverQueryEngine, where
the LLM recognises the chunks' text in the prompt instead. Prints answers, TTFT and reused tokens, and
streams one answer.

    python examples/llamaindex_rag.py
    python examples/llamaindex_rag.py --corpus /tmp/c --lazy-kv --questions 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import SimpleSummarize
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.retrievers.cacheblend import CacheBlendQueryEngine, CacheBlendRetriever

from cacheblend_rag import get_settings
from cacheblend_rag.ingest import ingest

DATA = Path(__file__).parent / "data"


class EngineReports(BaseEventHandler):
    """Keeps the engine's report (``raw``) of every LLM chat call, through LlamaIndex instrumentation."""

    reports: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "EngineReports"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None and event.response.raw:
            self.reports.append(event.response.raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--corpus", dest="corpus", type=Path, default=get_settings().home / "stores" / "sample"
    )
    parser.add_argument("--lazy-kv", action="store_true", help="compute chunk KV on first use, not at ingest")
    parser.add_argument("--questions", type=int, default=4, help="how many sample questions to ask")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    # unchanged files are skipped; the settings (CACHEBLEND_*) are passed down as the integrations do
    ingest([DATA / "corpus"], args.corpus, precompute_kv=not args.lazy_kv, config=get_settings())

    reports = EngineReports()
    get_dispatcher().add_event_handler(reports)
    llm = CacheBlendLLM(corpus_dir=str(args.corpus), max_tokens=args.max_tokens)
    by_node = CacheBlendQueryEngine.from_corpus(args.corpus, llm=llm, similarity_top_k=args.top_k)
    by_text = RetrieverQueryEngine(
        CacheBlendRetriever(args.corpus, args.top_k), response_synthesizer=SimpleSummarize(llm=llm)
    )
    # one-time start-up costs (loads the model), on a retrieved node passed as a document: a bare prompt
    # such as "Hi" holds no stored chunk, and the model would rightly warn that it reuses nothing
    (node,) = CacheBlendRetriever(args.corpus, 1).retrieve("warm-up")
    llm.complete(node.get_content(), max_tokens=1, documents=[node])

    questions = json.loads((DATA / "questions.json").read_text())[: args.questions]
    for item in questions:
        print(f"\nQ: {item['question']}  (gold: {', '.join(item['answers'])})")
        for name, engine in (("CacheBlendQueryEngine", by_node), ("stock + recognition", by_text)):
            response = engine.query(item["question"])
            report = reports.reports[-1]
            print(
                f"  {name:<21} TTFT {report['ttft_s'] * 1000:6.0f} ms, "
                f"{report['reused_tokens']}/{report['prompt_tokens']} prompt tokens reused: "
                f"{str(response).strip()}"
            )

    streaming = CacheBlendQueryEngine.from_corpus(
        args.corpus, llm=llm, similarity_top_k=args.top_k, streaming=True
    )
    print(f"\nStreaming: {questions[0]['question']}\n  ", end="")
    for token in streaming.query(questions[0]["question"]).response_gen:
        print(token, end="", flush=True)
    print()
    llm.close()  # waits for the scheduler to finish (a worker thread cut off at exit can abort the process)


if __name__ == "__main__":
    main()
