"""Chat messages with chunk parts become prompt parts structurally, on the model's real tokenizer: one
render with a stand-in per chunk, the text between them encoded fresh, each chunk its stored token ids."""

from __future__ import annotations

import copy
import itertools

import pytest

from cacheblend_rag.engine.prompt import (
    CHUNK_SEPARATOR,
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_TEMPLATE,
    ChunkRef,
    PromptBuilder,
    part_ids,
)

TEXTS = [
    "Gotthold Ephraim Lessing wrote Miss Sara Sampson in 1755.",
    "Nathan the Wise is a play by Lessing, first performed in 1783.",
    "Emilia Galotti is a tragedy in five acts.",
]
QUESTION = "What else did the author of Miss Sara Sampson write?"


@pytest.fixture(scope="module")
def builder(model_tokenizer) -> PromptBuilder:
    return PromptBuilder(model_tokenizer.tokenizer)


@pytest.fixture(scope="module")
def refs(builder) -> list[ChunkRef]:
    return [ChunkRef(tuple(builder.encode(text)), f"{i:032x}") for i, text in enumerate(TEXTS)]


def test_a_rag_chat_with_chunk_parts_is_the_engines_own_rag_prompt(builder, refs):
    before, after = DEFAULT_USER_TEMPLATE.split("{passages}")
    content = [before, refs[0], CHUNK_SEPARATOR, refs[1], after.format(question=QUESTION)]
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": content}]
    parts = builder.chat_parts(messages)
    assert parts == builder.rag_parts(QUESTION, refs[:2])  # the same token ids, cut at the same places
    chunk_parts = [p for p in parts if isinstance(p, ChunkRef)]
    assert chunk_parts[0] is refs[0] and chunk_parts[1] is refs[1]  # the stored ids, as given


def test_the_ids_are_the_pasted_chats_where_no_token_spans_a_chunk_edge(builder, refs):
    def both(before: str) -> tuple[list[int], list[int]]:
        parts = builder.chat_parts([{"role": "user", "content": [before, refs[0], "\n\nWho?"]}])
        pasted = [{"role": "user", "content": f"{before}{TEXTS[0]}\n\nWho?"}]
        return [t for p in parts for t in part_ids(p)], builder.chat_ids(pasted)

    # after a newline or punctuation (the RAG template's edges) the pasted chat tokenizes the same
    for before in ("Passages:\n", "Passage:", ""):
        ids, pasted = both(before)
        assert ids == pasted, before
    # a space before a chunk: tokenized whole, the space joins the chunk's first word; here it stays apart
    ids, pasted = both("Passage: ")
    assert ids != pasted and len(ids) == len(pasted) + 1


def test_chunks_come_in_rendered_order_between_fresh_text(builder, refs, model_tokenizer):
    messages = [
        {"role": "system", "content": ["Context: ", refs[2]]},
        {"role": "user", "content": ["First ", refs[0], " then ", refs[1], " and a question?"]},
        {"role": "assistant", "content": "An answer."},
        {"role": "user", "content": "More?"},
    ]
    parts = builder.chat_parts(messages)
    assert [p for p in parts if isinstance(p, ChunkRef)] == [refs[2], refs[0], refs[1]]
    # fresh text between the chunks, one non-empty run at a time
    assert all(isinstance(p, ChunkRef) or (isinstance(p, tuple) and p) for p in parts)
    assert not any(isinstance(a, tuple) and isinstance(b, tuple) for a, b in itertools.pairwise(parts))
    # the model sees the chunks' text where they were named: decoding the parts gives the pasted chat
    pasted = [
        {**m, "content": "".join(p if isinstance(p, str) else TEXTS[refs.index(p)] for p in m["content"])}
        for m in messages
    ]
    ids = [t for p in parts for t in part_ids(p)]
    assert model_tokenizer.tokenizer.decode(ids) == builder.render_chat(pasted)
    # a chat of text only is one fresh part: the chat's own token ids
    assert builder.chat_parts(pasted[2:]) == [tuple(builder.chat_ids(pasted[2:]))]


def test_a_stand_in_clash_is_refused(builder, refs, model_tokenizer):
    # text holding Private Use Area characters: the stand-ins avoid them, the text stays fresh text
    odd = "\ue000\ue001 marks"
    parts = builder.chat_parts([{"role": "user", "content": [odd, refs[0]]}])
    assert parts[1] is refs[0] and odd in model_tokenizer.tokenizer.decode(parts[0])
    # a template that renders a message twice renders its chunk twice: no single place for the chunk
    twice = copy.deepcopy(model_tokenizer.tokenizer)
    twice.chat_template = "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=f"rendered chunk {refs[0].chunk_id} 2 times"):
        PromptBuilder(twice).chat_parts([{"role": "user", "content": ["Read: ", refs[0]]}])
    dropped = copy.deepcopy(model_tokenizer.tokenizer)
    dropped.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="0 times"):
        PromptBuilder(dropped).chat_parts([{"role": "user", "content": [refs[0]]}])
    with pytest.raises(ValueError, match="text or a ChunkRef, not dict"):
        builder.chat_parts([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
