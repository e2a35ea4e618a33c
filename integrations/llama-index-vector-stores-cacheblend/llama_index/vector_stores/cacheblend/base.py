"""``CacheBlendVectorStore``: a LlamaIndex vector store whose nodes' chunk KV is precomputed for
:class:`~llama_index.llms.cacheblend.CacheBlendLLM`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Unpack

from llama_index.core import Settings
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TextNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

from cacheblend_rag.check import CheckReport
from cacheblend_rag.corpus import AllOf, AnyOf, Condition, ExternalEmbedder, Filter, KeyIn, Not
from cacheblend_rag.corpus.embedder import identity_of_folder
from cacheblend_rag.engine.session import Session
from cacheblend_rag.frontend import CollectionOptions, DocumentCollection
from cacheblend_rag.settings import get_settings

from .embedding import CacheBlendEmbedding

_OPERATORS = {
    FilterOperator.EQ: "eq",
    FilterOperator.NE: "ne",
    FilterOperator.GT: "gt",
    FilterOperator.GTE: "gte",
    FilterOperator.LT: "lt",
    FilterOperator.LTE: "lte",
    FilterOperator.IN: "in",
    FilterOperator.NIN: "nin",
    FilterOperator.CONTAINS: "contains",
}


class CacheBlendVectorStore(BasePydanticVectorStore):
    """Nodes in a cacheblend-rag corpus directory, with each chunk's KV precomputed so
    ``CacheBlendLLM(corpus_dir=...)`` over the same directory reuses it in any query engine.

    ``corpus_dir`` may be empty or missing: it becomes a corpus. Each node is stored under its node id
    with its metadata and cut into token-exact chunks of at most ``chunk_tokens`` of the model's tokens
    (a node that fits stays one chunk); queries return nodes whole, with their exact text, so the LLM
    recognises their chunks in the prompt a synthesizer writes. Vectors are the nodes' embeddings from
    ``embed_model``, the model the index embeds with (pass the store's ``embed_model`` to
    ``VectorStoreIndex`` too). Its default is ``Settings.embed_model`` when you set one, else the
    corpus's own embedder as a :class:`CacheBlendEmbedding` (all-MiniLM-L6-v2, shipped with
    cacheblend-rag: offline, no API key), which also opens a corpus built by ``cacheblend-rag ingest``.
    The model is recorded by identity: its name, dimension and, for a model read from a local folder
    (``HuggingFaceEmbedding(model_name=FOLDER)``), a digest of its weights, so the corpus reopens with the
    same weights wherever they lie now (a moved virtual environment) and from every front end with that
    model; a model known only by name needs that name again. Scores are cosine similarities.
    ``MetadataFilters`` (EQ, NE, GT, GTE, LT, LTE, IN, NIN, CONTAINS, ANY, ALL; AND,
    OR, NOT) are applied inside the search. ``precompute_kv=False`` computes chunk KV on first use.
    ``close()`` gives back the shared model.
    """

    stores_text: bool = True
    is_embedding_query: bool = True
    flat_metadata: bool = False
    corpus_dir: str
    precompute_kv: bool = True

    _documents: DocumentCollection = PrivateAttr()
    _embed_model: BaseEmbedding = PrivateAttr()

    def __init__(
        self,
        corpus_dir: str | os.PathLike[str],
        embed_model: BaseEmbedding | None = None,
        *,
        embedding_name: str | None = None,
        **options: Unpack[CollectionOptions],
    ) -> None:
        """``options``: ``model``, ``chunk_tokens``, ``index_type``, ``precompute_kv`` (see
        :class:`~cacheblend_rag.frontend.DocumentCollection`)."""
        super().__init__(corpus_dir=os.fspath(corpus_dir), precompute_kv=options.get("precompute_kv", True))
        # LlamaIndex's own default (Settings.embed_model unset) is OpenAI's API: only a model the user
        # set is taken from Settings, else the corpus's own embedder, which needs no network
        chosen = embed_model if embed_model is not None else getattr(Settings, "_embed_model", None)
        if chosen is None or isinstance(chosen, CacheBlendEmbedding):
            given = chosen.embedder if chosen is not None else None
            self._documents = DocumentCollection(corpus_dir, given, config=get_settings(), **options)
            self._embed_model = chosen or CacheBlendEmbedding(embedder=self._documents.corpus.embedder)
            return
        self._embed_model = chosen
        self._documents = DocumentCollection(
            corpus_dir, _external(chosen, embedding_name), config=get_settings(), **options
        )

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendVectorStore"

    @property
    def client(self) -> DocumentCollection:
        """The corpus behind the store (its documents, corpus and shared engine)."""
        return self._documents

    @property
    def session(self) -> Session:
        """The corpus and the shared engine over it, as every LLM over the corpus holds them (the engine
        is loaded on first use)."""
        return self._documents.session

    @property
    def embed_model(self) -> BaseEmbedding:
        return self._embed_model

    def close(self) -> None:
        """Give back the store's hold on the shared model (the last holder frees it)."""
        self._documents.close()

    # -- writing -------------------------------------------------------------------------------------

    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Store nodes under their ids (replacing any stored under the same id) with their embeddings
        (a node without one is embedded with ``embed_model``); returns the ids."""
        if add_kwargs:
            raise TypeError(f"unsupported option(s) {', '.join(sorted(add_kwargs))}")
        if not nodes:
            return []
        self._documents.add(
            [node.get_content(metadata_mode=MetadataMode.NONE) for node in nodes],
            [node.node_id for node in nodes],
            [
                node_to_metadata_dict(node, remove_text=True, flat_metadata=self.flat_metadata)
                for node in nodes
            ],
            [node.embedding for node in nodes],
        )
        return [node.node_id for node in nodes]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete the nodes of the document ``ref_doc_id``, with the rows, vectors and KV of the chunks no
        other node holds."""
        self._documents.delete(self._documents.ids({"ref_doc_id": ref_doc_id}))

    def delete_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
        **delete_kwargs: Any,
    ) -> None:
        """Delete the nodes with these ids and/or matching ``filters``."""
        self._documents.delete(self._documents.ids(_selection(node_ids, filters)))

    def clear(self) -> None:
        """Delete every node."""
        self._documents.delete(self._documents.ids())

    # -- reading -------------------------------------------------------------------------------------

    def check(self, questions: Sequence[str] | None = None, **options: Any) -> CheckReport:
        """Full prefill against KV reuse on this store's documents: see ``CacheBlendRAG.check`` (the
        options: ratios, method, target_agreement, max_tokens, sample, top_k)."""
        return self._documents.check(questions, **options)

    def get_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None
    ) -> list[BaseNode]:
        """The nodes with these ids and/or matching ``filters``, as added."""
        documents = self._documents.get(self._documents.ids(_selection(node_ids, filters)))
        return [_node(doc.key, doc.text, doc.metadata) for doc in documents]

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """The ``similarity_top_k`` nodes nearest to the query embedding (or ``query_str``, embedded),
        among nodes matching ``filters``, ``doc_ids`` and ``node_ids``; best first."""
        if query.mode != VectorStoreQueryMode.DEFAULT:
            raise ValueError(
                f"CacheBlendVectorStore supports the default (dense) query mode, not {query.mode}"
            )
        where = _selection(query.node_ids, query.filters)
        if query.doc_ids:
            by_document = Condition("ref_doc_id", "in", list(query.doc_ids))
            where = by_document if where is None else AllOf((where, by_document))
        target = query.query_embedding if query.query_embedding is not None else query.query_str
        if target is None:
            raise ValueError("a query needs query_embedding or query_str")
        hits = self._documents.search(target, query.similarity_top_k, where, whole_documents=True)
        return VectorStoreQueryResult(
            nodes=[_node(hit.key, hit.text, hit.metadata) for hit in hits],
            similarities=[hit.score for hit in hits],
            ids=[hit.key for hit in hits],
        )


def _external(embed_model: BaseEmbedding, embedding_name: str | None) -> ExternalEmbedder:
    """``embed_model`` as the corpus's embedder, identified by ``embedding_name`` if given, else by its
    weights when it reads a local folder (``model_name``), else by class and model name."""
    label = embed_model.class_name()
    name, sha = embedding_name or f"{label}:{embed_model.model_name}", ""
    folder = Path(str(embed_model.model_name or "")).expanduser()
    if embedding_name is None and embed_model.model_name and folder.is_dir():
        name, sha = identity_of_folder(label, folder)
    return ExternalEmbedder(
        name, embed_model.get_text_embedding_batch, embed_model.get_query_embedding, sha256=sha
    )


def _node(key: str, text: str, metadata: dict[str, Any]) -> BaseNode:
    """A stored node back as a node; a document that was not a node (ingested from a file) as a TextNode."""
    if "_node_content" in metadata:
        return metadata_dict_to_node(metadata, text=text)
    return TextNode(id_=key, text=text, metadata=metadata)


def _selection(node_ids: Sequence[str] | None, filters: MetadataFilters | None) -> Filter | None:
    parts: list[Filter] = []
    if node_ids:  # an empty list means no restriction (what VectorStoreIndex passes)
        parts.append(KeyIn(tuple(node_ids)))
    if filters is not None and filters.filters:
        parts.append(to_filter(filters))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else AllOf(tuple(parts))


def to_filter(filters: MetadataFilters) -> Filter:
    """LlamaIndex ``MetadataFilters`` as a cacheblend-rag filter (applied inside the corpus's search)."""
    parts = tuple(to_filter(f) if isinstance(f, MetadataFilters) else _condition(f) for f in filters.filters)
    if filters.condition in (None, FilterCondition.AND):
        return AllOf(parts)
    if filters.condition == FilterCondition.OR:
        return AnyOf(parts)
    return Not(AllOf(parts))  # FilterCondition.NOT


def _condition(item: MetadataFilter) -> Filter:
    operator = FilterOperator(item.operator)
    if operator in _OPERATORS:
        return Condition(item.key, _OPERATORS[operator], item.value)
    if operator in (FilterOperator.ANY, FilterOperator.ALL):
        each = tuple(Condition(item.key, "contains", v) for v in item.value or ())
        return AnyOf(each) if operator == FilterOperator.ANY else AllOf(each)
    supported = ", ".join(o.name for o in (*_OPERATORS, FilterOperator.ANY, FilterOperator.ALL))
    raise ValueError(f"filter operator {operator.name} is not supported; supported: {supported}")
