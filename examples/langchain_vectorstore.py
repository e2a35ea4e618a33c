"""LangChain, starting from your own documents: split them with your splitter, keep the splits in a
CacheBlendVectorStore (an empty folder becomes a corpus; each split's chunk KV is precomputed as it is
added), and a plain chain with ChatCacheBlend reuses that KV from the first question on.

    python examples/langchain_vectorstore.py
    python examples/langchain_vectorstore.py --corpus /tmp/my-corpus --files 1 --questions 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from langchain_cacheblend import CacheBlendVectorStore, ChatCacheBlend
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_text_splitters import RecursiveCharacterTextSplitter

from cacheblend_rag import get_settings

DATA = Path(__file__).parent / "data"
FILES = ("musique_case005.md", "musique_case013.txt", "musique_case038.md", "musique_case010.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=get_settings().home / "stores" / "langchain-own")
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

    corpus_dir, max_tokens = args.corpus, args.max_tokens

    # -- README: LangChain, from your own documents --
    documents = [
        Document(page_content=p.read_text(encoding="utf-8"), metadata={"source": p.name}) for p in paths
    ]
    splits = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=0).split_documents(documents)
    ids = [f"{split.metadata['source']}#{i}" for i, split in enumerate(splits)]  # stable: re-runs replace

    store = CacheBlendVectorStore.from_documents(splits, ids=ids, corpus_dir=corpus_dir)
    retriever = store.as_retriever(search_kwargs={"k": 3})

    def format_docs(docs: list[Document]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from the context. Be brief."),
            ("human", "Context:\n{context}\n\nQuestion: {question}"),
        ]
    )
    llm = ChatCacheBlend(corpus_dir=corpus_dir, max_tokens=max_tokens)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    # -- end --

    for item in questions[: args.questions]:
        message = chain.invoke(item["question"])
        usage = message.usage_metadata
        print(f"\nQ: {item['question']}  (gold: {', '.join(item['answers'])})")
        print(
            f"  cacheblend   TTFT {message.response_metadata['ttft_s'] * 1000:6.0f} ms, "
            f"{usage['input_token_details']['cache_read']}/{usage['input_tokens']} prompt tokens reused: "
            f"{message.content.strip()}"
        )
    filtered = store.similarity_search(questions[0]["question"], k=2, filter={"source": paths[0].name})
    print(f"\nfilter={{'source': {paths[0].name!r}}}: {[d.id for d in filtered]}")
    llm.close()
    store.close()


if __name__ == "__main__":
    main()
