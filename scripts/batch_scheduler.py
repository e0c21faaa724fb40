"""The server's scheduler (`opttree.server.batcher.Batcher`) without HTTP: one request at a time against continuous
batching with sized trees and with per-request budgets, the same load from client threads, interleaved round by
round (the first round is a warm-up, left out of the means).

    python scripts/batch_scheduler.py --limit 32 --rounds 3 --budgets 16,15,8,4
    python scripts/batch_scheduler.py --limit 32 --rounds 7 --budgets 4 --cut-after
    python scripts/batch_scheduler.py --limit 64 --rounds 4 --budgets 4 --own-prefills
    python scripts/batch_scheduler.py --limit 16 --rounds 5 --budgets 4 --listed-on-device
    python scripts/batch_scheduler.py --limit 16 --rounds 4 --budgets 4 --split
    python scripts/batch_scheduler.py --limit 16 --rounds 5 --budgets 4 --split --without-room
    python scripts/batch_scheduler.py --limit 16 --rounds 6 --budgets 4 --split --learning-by-rows --trees-by-rows

Each client thread sends its share of the prompts (HumanEval's first --limit) one after another, temperature 0,
--max-tokens each, `opt:recycling+lookup` on the shipped pair; prints the wall seconds of every round, the mean's
speedup over one request at a time, the median request latency, and per request and step its drafting ms (its
share of the step's drafting, the cut and its source's learning) and the tokens it gained; and where the scheduler's
time went: the share of the wall spent joining requests (their prefills and the batch's cache stacked anew) and
in steps, and the mean rows a step. `--split`: also each server's step split into its phases (ms a step: the verify
forward of steps that carry joining prompts and of the others, each row's drafting, acceptance and learning, the
cache's compaction, seating the rows that rode a step), timed around the engine's calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

import opttree
from opttree.batch_sizing import SizedBudget, batch_latency
from opttree.bench.prompts import load_prompts
from opttree.server.app import CompletionRequest, Server
from opttree import engine
from opttree.engine import Generation, Row
from opttree.server.batcher import Lane
from opttree.step.drafters.recycling import RecyclingMatrix
from opttree.step.verify import TreeVerifier

SPENT: dict[str, list[float]] = {"join": [], "step": []}  # seconds of each call, this round
ROWS: list[int] = []  # rows of each step, this round


def timed(name: str):
    """Lane.join / Lane.step, each call's seconds (and a step's rows) recorded."""
    method = getattr(Lane, name)

    def run(lane, *args, **kwargs):
        if name == "step":
            ROWS.append(len(lane.jobs))
        began = time.perf_counter()
        try:
            return method(lane, *args, **kwargs)
        finally:
            SPENT[name].append(time.perf_counter() - began)
    return run


Lane.join, Lane.step = timed("join"), timed("step")
# what the server that runs now does: keep room for its rows in its batch's cache; its rows' Token Recycling learn
# from a step together (off: each row as it observes, as before); its rows' trees listed on the host grow together
SWITCHES = {"room": True, "learn together": True, "trees together": True}
_join = Lane.join
Lane.join = lambda lane, jobs, target, allocator, rows_room=0: _join(lane, jobs, target, allocator,
                                                                    rows_room if SWITCHES["room"] else 0)
_queue = RecyclingMatrix.queue


def queue(matrix: RecyclingMatrix, *step) -> None:
    _queue(matrix, *step)
    if not SWITCHES["learn together"]:
        matrix.learn()


RecyclingMatrix.queue = queue
_groups = engine.listed_groups
engine.listed_groups = lambda builds: _groups(builds) if SWITCHES["trees together"] else []

# Sized servers that differ from the default in one way, each behind a flag: flag -> (its name, the flag's help, the
# environment it runs in, the SWITCHES it turns off). The others run with the defaults.
VARIANTS = {
    "own-prefills": ("sized (16), prefills of their own", "each joining request prefilled in a forward of its own "
                     "(OPTTREE_RIDE=0) instead of in the next step's", {"OPTTREE_RIDE": "0"}, ()),
    "without-room": ("sized (16), no room for rows", "a batch's cache made anew as each row joins (no room kept for "
                     "the server's rows)", {}, ("room",)),
    "listed-on-device": ("sized (16), children listed on the device", "Token Recycling's children listed by its "
                         "tensors (OPTTREE_LISTED=device) instead of on the host", {"OPTTREE_LISTED": "device"}, ()),
    "learning-by-rows": ("sized (16), learning row by row", "Token Recycling's matrix learning from each row's step "
                         "as the row observes it, not once for every row", {}, ("learn together",)),
    "trees-by-rows": ("sized (16), trees row by row", "each row's tree built on its own, not every row's listed "
                      "on the host together", {}, ("trees together",)),
}
DEFAULTS = {"OPTTREE_RIDE": "1", "OPTTREE_LISTED": "host"}

PHASES: dict[str, float] = {}  # seconds in each phase of the steps, this round (`--split`)
RIDES: list[int] = []  # steps whose forward carried joining prompts, this round


def clock_phases() -> None:
    """The engine's phases timed into PHASES (`--split`): wrappers around its calls."""
    def clocked(owner, name: str, phase) -> None:
        method = getattr(owner, name)

        def run(*args, **kwargs):
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                key = phase(*args, **kwargs) if callable(phase) else phase
                PHASES[key] = PHASES.get(key, 0.0) + time.perf_counter() - began
        setattr(owner, name, run)

    def forward(verifier, cache, roots, trees, prefix_lens, riders=()):
        if riders:
            RIDES.append(1)
        return "verify, steps with joining prompts" if riders else "verify, other steps"

    clocked(TreeVerifier, "logits", forward)
    for owner, name, phase in [(Generation, "_draft", "drafting"), (Row, "accept", "acceptance"),
                               (Row, "learn", "learning"), (engine, "_learned_together", "learning"),
                               (TreeVerifier, "commit", "compaction"), (Generation, "_leave", "seating and leaving")]:
        clocked(owner, name, phase)


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
    parser.add_argument("--split", action="store_true", help="also each server's step split into its phases")
    for flag, (_, help_text, _, _) in VARIANTS.items():
        parser.add_argument(f"--{flag}", action="store_true", help=f"also the sized trees with {help_text}")
    args = parser.parse_args()
    if args.split:
        clock_phases()
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
    variants = {}  # server name -> (environment, switches off)
    for flag, (name, _, env, off) in VARIANTS.items():
        if getattr(args, flag.replace("-", "_")):
            servers[name] = server(16, args.clients, SizedBudget)
            variants[name] = env, off
    servers.update({f"budget {b} each": server(int(b), args.clients) for b in args.budgets.split(",")})

    def load(srv: Server) -> tuple[float, list[float], list, tuple[float, float, float]]:
        latencies: list[float] = []
        stats: list = []
        for spent in (*SPENT.values(), ROWS, RIDES):
            spent.clear()
        PHASES.clear()

        def client(mine: list[str]) -> None:
            for prompt in mine:
                began = time.perf_counter()
                job, _ = srv.start(CompletionRequest(prompt=prompt, max_tokens=args.max_tokens, temperature=0))
                job.result()
                latencies.append(time.perf_counter() - began)
                stats.append(job.stats)

        threads = [threading.Thread(target=client, args=(prompts[i::args.clients],)) for i in range(args.clients)]
        began = time.perf_counter()
        env, off = variants.get(next(name for name, other in servers.items() if other is srv), ({}, ()))
        os.environ.update({**DEFAULTS, **env})
        SWITCHES.update({switch: switch not in off for switch in SWITCHES})
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        steps = len(SPENT["step"])
        split = {phase: 1e3 * seconds / steps for phase, seconds in PHASES.items()}  # ms a step
        split["steps with joining prompts"] = len(RIDES)
        split["steps"] = steps
        return wall, latencies, stats, (sum(SPENT["join"]) / wall, sum(SPENT["step"]) / wall, statistics.fmean(ROWS),
                                        split)

    runs: dict[str, list[tuple[float, list[float], list, tuple]]] = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, srv in servers.items():
            runs[name].append(load(srv))
    timed = {name: r[1:] or r for name, r in runs.items()}  # the first round warms up
    base = statistics.fmean(wall for wall, *_ in timed["one at a time (16)"])
    print(f"{len(prompts)} requests x {args.max_tokens} tokens from {args.clients} clients, {args.dtype}")
    print("| scheduler | wall s by round | speedup | p50 latency s | drafting ms a request a step | tokens a request "
          "a step | joining, % of wall | steps, % of wall | rows a step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rounds in timed.items():
        wall = statistics.fmean(w for w, *_ in rounds)
        p50 = statistics.median(x for _, lat, _, _ in rounds for x in lat)
        every = [st for _, _, stats, _ in rounds for st in stats]
        steps = sum(st.steps for st in every)
        drafting, tokens = 1e3 * sum(st.draft_s for st in every) / steps, sum(st.new_tokens for st in every) / steps
        joining, stepping, rows = (statistics.fmean(r[3][i] for r in rounds) for i in range(3))
        print(f"| {name} | {', '.join(f'{w:.2f}' for w, *_ in runs[name])} | {base / wall:.2f}x | {p50:.2f} | "
              f"{drafting:.2f} | {tokens:.2f} | {100 * joining:.0f} | {100 * stepping:.0f} | {rows:.2f} |")
    if args.split:
        phases = ["verify, other steps", "verify, steps with joining prompts", "drafting", "acceptance", "learning",
                  "compaction", "seating and leaving", "steps with joining prompts", "steps"]
        print("\nThe step's phases, ms a step (the mean over all steps of a round; the last two: counts a round)")
        print("| scheduler | " + " | ".join(phases) + " |")
        print("|---|" + "---:|" * len(phases))
        for name, rounds in timed.items():
            means = [statistics.fmean(r[3][3].get(phase, 0.0) for r in rounds) for phase in phases]
            print(f"| {name} | " + " | ".join(f"{m:.1f}" if i < len(phases) - 2 else f"{m:.0f}"
                                             for i, m in enumerate(means)) + " |")


if __name__ == "__main__":
    main()
