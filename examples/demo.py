"""Demo: answer a fixed question with the default model through our layer-wise runtime (greedy decoding).

Run with ``make demo``. The RAG demo (ingest documents, answer from blended chunk caches) replaces this.
"""

from __future__ import annotations

import time

import torch

from cacheblend_rag.models.loader import load_model

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_NEW_TOKENS = 48


def main() -> None:
    model = load_model()
    tokenizer = model.tokenizer
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    start = time.perf_counter()
    logits, cache = model.prefill(prompt_ids, extra_capacity=MAX_NEW_TOKENS)
    answer: list[int] = []
    for position in range(len(prompt_ids), len(prompt_ids) + MAX_NEW_TOKENS):
        token = int(logits[0].argmax())
        if token == tokenizer.eos_token_id:
            break
        answer.append(token)
        logits = model.forward(torch.tensor([[token]]), torch.tensor([position]), cache)
    elapsed = time.perf_counter() - start
    print(f"model: {model.name}")
    print(f"Q: {QUESTION}")
    print(f"A: {tokenizer.decode(answer, skip_special_tokens=True).strip()}")
    print(f"({len(prompt_ids)} prompt tokens, {len(answer)} generated in {elapsed:.1f} s)")


if __name__ == "__main__":
    main()
