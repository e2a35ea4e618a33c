"""LlamaIndex, starting from your own documents: a stock VectorStoreIndex over CacheBlendVectorStore (an
empty folder becomes a corpus; each node's chunk KV is precomputed as it is added), queried through
``index.as_query_engine(llm=CacheBlendLLM(...))``: every query reuses the KV of the nodes it retrieves.

    python examples/llamaindex_vectorstore.py
    python examples/llamaindex_vectorstore.py --corpus /tmp/my-corpus --files 1 --questions 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.vector_stores.cacheblend import CacheBlendVectorStore

from cacheblend_rag import get_settings

DATA = Path(__file__).parent / "data"
FILES = ("musique_case005.md", "musique_case013.txt", "musique_case038.md", "musique_case010.jsonl")


class Usage(BaseEventHandler):
    """Keeps what CacheBlendLLM reports about each answer (``response.raw``), through instrumentation."""

    reports: list[dict[str, Any]] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "Usage"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None and event.response.raw:
            self.reports.append(event.response.raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=get_settings().home / "stores" / "llamaindex-own")
    parser.add_argument("--files", type=int, default=len(FILES), help="how many of the sample files to use")
    parser.add_argument("--questions", type=int, default=4, help="how many sample questions to ask")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    paths = [DATA / "corpus" / name for name in FILES[: args.files]]
    questions = [
        q
        for q in json.loads((DATA / "questions.json").read_text())
        if Path(q["file"]).name in FILES[: args.files]
    ]
    usage = Usage()
    get_dispatcher().add_event_handler(usage)

    corpus_dir, max_tokens = args.corpus, args.max_tokens

    # -- README: LlamaIndex, from your own documents --
    documents = [
        Document(text=p.read_text(encoding="utf-8"), metadata={"file_name": p.name}, id_=p.name)
        for p in paths
    ]
    vector_store = CacheBlendVectorStore(corpus_dir)  # cacheblend-rag's own embedder: offline, no API key
    embed_model = vector_store.embed_model  # or any LlamaIndex embed model, given to the store and index
    for document in documents:  # indexing again replaces a document's nodes rather than adding copies
        vector_store.delete(document.doc_id)
    index = VectorStoreIndex.from_documents(
        documents,
        storage_context=StorageContext.from_defaults(vector_store=vector_store),
        embed_model=embed_model,
    )
    llm = CacheBlendLLM(corpus_dir=corpus_dir, max_tokens=max_tokens)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    # -- end --

    for item in questions[: args.questions]:
        response = query_engine.query(item["question"])
        report = usage.reports[-1]
        print(f"\nQ: {item['question']}  (gold: {', '.join(item['answers'])})")
        print(
            f"  VectorStoreIndex TTFT {report['ttft_s'] * 1000:6.0f} ms, "
            f"{report['usage']['prompt_tokens_details']['cached_tokens']}/{report['usage']['prompt_tokens']} "
            f"prompt tokens reused: {str(response).strip()}"
        )
    llm.close()
    vector_store.close()


if __name__ == "__main__":
    main()
