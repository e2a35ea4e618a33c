"""Did a speed change leave the default fusion's results as they were? Save, then compare.

    .venv/bin/python tools/check_fusion_equal.py --save before.pt     # on the old code
    .venv/bin/python tools/check_fusion_equal.py --compare before.pt  # on the new code

Fuses a few real RAG prompts (MuSiQue cases of tests/data, up to six 512-token chunks, chunk KV in fp16
as the RAM tier holds it, plus the 6 x 512 prompt of ``scripts/profile_fusion.py``) with a method (default:
``cacheblend``'s defaults) and records per prompt the recomputed positions, the probe's scores, the
first-token logits and a short greedy continuation. ``--compare`` exits non-zero unless the positions
and greedy tokens are identical and the first-token probabilities agree within ``--tolerance``. Point
PYTHONPATH at the checkout to test (the old one for ``--save``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

from cacheblend_rag.blend import DirectLayerKV, Fusor, Segment, parse_method
from cacheblend_rag.blend.segments import ChunkContext, prefill_chunk_kv
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.tokenizer import chunk_context_ids
from cacheblend_rag.text.chunker import Chunker

HERE = Path(__file__).resolve().parent
CASES = HERE.parent / "tests" / "data" / "musique_24.json"


def musique_prompts(model, count: int) -> list[list[Segment]]:
    tok = model.tokenizer
    context = ChunkContext(chunk_context_ids(tok, "neutral"))
    chunker = Chunker(tok, 512)
    prompts = []
    for case in json.loads(CASES.read_text())[:count]:
        text = "\n\n".join(c["title"] + "\n" + c["text"] for c in case["ctxs"])
        chunks = [
            ChunkRef(c.token_ids, None, prefill_chunk_kv(model, c.token_ids, context).to(torch.float16))
            for c in chunker.split(text)[:6]
        ]
        prompts.append(PromptBuilder(tok).rag_segments(case["question"], chunks))
    return prompts


def profile_prompt(model) -> list[Segment]:
    path = HERE.parent / "scripts" / "profile_fusion.py"
    spec = importlib.util.spec_from_file_location("profile_fusion", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_prompt(model, 6, 512)


def greedy(model, fused, steps: int) -> list[int]:
    tokens = [int(fused.logits.argmax())]
    cache, position = fused.cache, fused.num_tokens
    for _ in range(steps - 1):
        logits = model.forward(torch.tensor([[tokens[-1]]]), torch.tensor([position]), cache)
        tokens.append(int(logits[0].argmax()))
        position += 1
    return tokens


def run(method_spec: str, count: int, steps: int, fusion: str) -> list[dict]:
    model = load_model()
    # the static steps are what an accelerator runs; forced here to compare them on the CPU
    fusor = Fusor(model) if fusion == "auto" else Fusor(model, static=fusion == "static")
    method = parse_method(method_spec).build()
    records = []
    for segments in [*musique_prompts(model, count), profile_prompt(model)]:
        kv = [s.kv for s in segments if s.kv is not None]
        fused = fusor.fuse(segments, method, DirectLayerKV(kv), extra_capacity=steps)
        records.append(
            {
                "selected": fused.selected.clone(),
                "attention": fused.plan.query_attention,
                "contribution": fused.plan.query_contribution,
                "logits": fused.logits.clone(),
                "greedy": greedy(model, fused, steps),
            }
        )
    return records


def compare(before: list[dict], after: list[dict], tolerance: float) -> bool:
    same = len(before) == len(after)
    for i, (old, new) in enumerate(zip(before, after, strict=False)):
        selected = torch.equal(old["selected"], new["selected"])
        prob_diff = (torch.softmax(old["logits"], -1) - torch.softmax(new["logits"], -1)).abs().max().item()
        logit_diff = (old["logits"] - new["logits"]).abs().max().item()
        scores = [k for k in ("attention", "contribution") if old[k] is not None and new[k] is not None]
        score_diff = max(
            (((old[k] - new[k]).abs().max() / old[k].abs().max()).item() for k in scores), default=0.0
        )
        ok = selected and old["greedy"] == new["greedy"] and prob_diff <= tolerance
        same &= ok
        print(
            f"prompt {i}: {len(old['selected'])} selected, identical {selected}; greedy "
            f"{'same' if old['greedy'] == new['greedy'] else 'DIFFERENT'}; max |dlogit| {logit_diff:.2e}, "
            f"max |dprob| {prob_diff:.2e}, probe scores rel {score_diff:.2e} -> {'ok' if ok else 'FAIL'}"
        )
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--save", type=Path)
    where.add_argument("--compare", type=Path)
    parser.add_argument("--method", default="cacheblend", help="a method spec, e.g. cacheblend@ratio=0.3")
    parser.add_argument("--prompts", type=int, default=4, help="MuSiQue prompts besides the 6 x 512 one")
    parser.add_argument("--steps", type=int, default=8, help="greedy tokens per prompt")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max first-token probability change")
    parser.add_argument(
        "--fusion",
        choices=("auto", "static", "layers"),
        default="auto",
        help="which fusion path (auto: the device's)",
    )
    args = parser.parse_args()
    records = run(args.method, args.prompts, args.steps, args.fusion)
    if args.save is not None:
        torch.save(records, args.save)
        print(f"saved {len(records)} prompts to {args.save}")
        return
    sys.exit(0 if compare(torch.load(args.compare), records, args.tolerance) else 1)


if __name__ == "__main__":
    main()
