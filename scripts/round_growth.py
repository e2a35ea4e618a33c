"""How a round's time grows with its agents (issue 21), side by side for variants of the round.

    .venv/bin/python scripts/round_growth.py [--agents 8 16] [--variants 8 1000 8/one] [--repeats 3]

The workload of ``bench --only round`` (scripts/profile_round.py's agents: role i, the same 6 MuSiQue
chunks of 512 tokens, question i; cacheblend at the default r; the chunks' KV in RAM), timed through the
batch scheduler with rounds on, all agents submitted at once: the time until every agent has its first
token. For each agent count and each variant, interleaved, median of ``--repeats``. A variant is a bound
on the questions the round's probe scores (``blend.round.PROBE_QUESTIONS``; a bound at least the agent
count is the unbounded probe), with ``/one`` after it for the members' attention as one masked call over
every member's slots (instead of the round's prompt and each member's own slots, merged). Then each
variant's growth from the first agent count to the last beside the growth of the tokens computed (the
round's one recompute plus every agent's own): the bench's check.
Run it on a quiet machine: a few minutes.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from profile_round import round_workload  # scripts/ is on sys.path when a script in it runs

from cacheblend_rag.blend import round as round_module
from cacheblend_rag.blend.round_members import MembersPass
from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.engine import SamplingParams
from cacheblend_rag.eval.bench.round import _timed, agent_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--agents", type=int, nargs="+", default=[8, 16])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["8", "1000"],
        help="a probe bound each, '/one' after it for the members' attention as one masked call",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with round_workload(6, 512, max(args.agents)) as (settings, engine, refs, questions):
        blend = parse_method("cacheblend").with_ratio(settings.ratio)
        sampling = SamplingParams(max_new_tokens=16)
        print(f"{torch.get_num_threads()} threads; agents {args.agents}; variants {args.variants}")
        split = MembersPass._split
        _timed(engine, agent_requests(engine, refs, questions[:2], blend, sampling, False), True)  # warm-up
        samples: dict[tuple[int, str], list[dict]] = {}
        for n in args.agents:
            for _ in range(args.repeats):
                for bound in args.variants:
                    round_module.PROBE_QUESTIONS = int(bound.split("/")[0])
                    MembersPass._split = (lambda self, dtype: None) if bound.endswith("/one") else split
                    batch = agent_requests(engine, refs, questions[:n], blend, sampling, own_order=False)
                    samples.setdefault((n, bound), []).append(_timed(engine, batch, rounds=True))
        for (n, bound), runs in samples.items():
            times = [r["all_first_tokens_s"] for r in runs]
            computed = runs[0]["round_recomputed_tokens"] + runs[0]["agent_computed_tokens"]
            median = statistics.median(times)
            print(
                f"agents {n:3d}  variant {bound:>8s}: all first tokens median {median:.3f} s "
                f"{[round(t, 3) for t in times]}; computed tokens {computed} "
                f"(round {runs[0]['round_recomputed_tokens']})"
            )
        low, high = min(args.agents), max(args.agents)
        for bound in args.variants:
            t0 = statistics.median(r["all_first_tokens_s"] for r in samples[(low, bound)])
            t1 = statistics.median(r["all_first_tokens_s"] for r in samples[(high, bound)])

            def computed(n: int, bound: str = bound) -> int:
                first = samples[(n, bound)][0]
                return first["round_recomputed_tokens"] + first["agent_computed_tokens"]

            print(
                f"variant {bound}: {low} -> {high} agents time +{t1 / t0 - 1:.0%}, computed tokens "
                f"+{computed(high) / computed(low) - 1:.0%}"
            )


if __name__ == "__main__":
    main()
