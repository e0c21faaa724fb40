"""The server's scheduler (`opttree.server.batcher.Batcher`) without HTTP: one request at a time against continuous
batching with sized trees and with per-request budgets, the same load from client threads, interleaved round by
round (the first round is a warm-up, left out of the means).

    python scripts/batch_scheduler.py --limit 32 --rounds 3 --budgets 16,15,8,4
    python scripts/batch_scheduler.py --limit 32 --rounds 7 --budgets 4 --cut-after

Each client thread sends its share of the prompts (HumanEval's first --limit) one after another, temperature 0,
--max-tokens each, `opt:recycling+lookup` on the shipped pair; prints the wall seconds of every round, the mean's
speedup over one request at a time, the median request latency, and per request and step its drafting ms (its
share of the step's drafting, the cut and its source's learning) and the tokens it gained.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import opttree
from opttree.batch_sizing import SizedBudget, batch_latency
from opttree.bench.prompts import load_prompts
from opttree.server.app import CompletionRequest, Server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budgets", default="16,8,4", help="per-request budgets of the batched servers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cut-after", action="store_true",
                        help="also the sized trees drafted at the request's budget and cut afterwards (as before "
                             "rows drafted at the batch's size)")
    args = parser.parse_args()
    target, _, tok = opttree.demo_models(getattr(torch, args.dtype))
    prompts = [p.text for p in load_prompts(args.prompts, limit=args.limit)]

    class CutAfter(SizedBudget):  # every greedy row drafts its own budget; the cut then keeps the sized nodes
        def nodes(self, costs):
            self.sized_now = super().nodes(costs)
            return [0 if n == 0 else None for n in self.sized_now]

        def __call__(self, trees, nodes):
            return super().__call__(trees, self.sized_now)

    def server(budget: int, max_batch: int, sized: type | None = None) -> Server:
        allocator = sized(batch_latency(target, max_batch)) if sized else None
        return Server(target, None, tok, dict(tree="opt", drafter="recycling+lookup", budget=budget), model_name="demo",
                      max_batch=max_batch, max_queue=4 * args.clients, batch_budget=allocator)

    servers = {"one at a time (16)": server(16, 1), "sized (16)": server(16, args.clients, SizedBudget)}
    if args.cut_after:
        servers["sized (16), cut after drafting"] = server(16, args.clients, CutAfter)
    servers.update({f"budget {b} each": server(int(b), args.clients) for b in args.budgets.split(",")})

    def load(srv: Server) -> tuple[float, list[float], list]:
        latencies: list[float] = []
        stats: list = []

        def client(mine: list[str]) -> None:
            for prompt in mine:
                began = time.perf_counter()
                job, _ = srv.start(CompletionRequest(prompt=prompt, max_tokens=args.max_tokens, temperature=0))
                job.result()
                latencies.append(time.perf_counter() - began)
                stats.append(job.stats)

        threads = [threading.Thread(target=client, args=(prompts[i::args.clients],)) for i in range(args.clients)]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - began, latencies, stats

    runs: dict[str, list[tuple[float, list[float], list]]] = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, srv in servers.items():
            runs[name].append(load(srv))
    timed = {name: r[1:] or r for name, r in runs.items()}  # the first round warms up
    base = statistics.fmean(wall for wall, _, _ in timed["one at a time (16)"])
    print(f"{len(prompts)} requests x {args.max_tokens} tokens from {args.clients} clients, {args.dtype}")
    print("| scheduler | wall s by round | speedup | p50 latency s | drafting ms a request a step | tokens a request "
          "a step |\n|---|---|---:|---:|---:|---:|")
    for name, rounds in timed.items():
        wall = statistics.fmean(w for w, _, _ in rounds)
        p50 = statistics.median(x for _, lat, _ in rounds for x in lat)
        every = [st for _, _, stats in rounds for st in stats]
        steps = sum(st.steps for st in every)
        drafting, tokens = 1e3 * sum(st.draft_s for st in every) / steps, sum(st.new_tokens for st in every) / steps
        print(f"| {name} | {', '.join(f'{w:.2f}' for w, _, _ in runs[name])} | {base / wall:.2f}x | {p50:.2f} | "
              f"{drafting:.2f} | {tokens:.2f} |")


if __name__ == "__main__":
    main()
