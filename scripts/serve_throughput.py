"""Aggregate throughput of `opttree serve` under concurrent clients: continuous batching (several
--max-batch values, 1 = one request at a time) in one process, interleaved round by round.

    python scripts/serve_throughput.py --prompts ../shared/data/humaneval.jsonl --limit 16 --max-tokens 64 \
        --clients 1,8 --batches 1,8 --batch-budgets off,auto --rounds 2

Each (max-batch, clients) cell sends the same prompts (temperature 0, or --temperature with each prompt's
index as its seed) from that many client threads
over HTTP to a real uvicorn server (the shipped pair in float32 unless --target / --draft / --device /
--dtype say otherwise) and prints the tokens per second
over all requests, the p50 / p99 request latency, where the scheduler's time went (from the server's
/metrics: seconds in the batch's steps, rows a step, the mean prefill a request joined with, the draft tokens
accepted a request a step), and whether every
answer equals the one of the first cell (greedy in float32, and sampled with the draft model in float32: they
must; in bf16 or fp16 "-": a tree forward rounds unlike another, and the sources learn across rounds). --batch-budgets: each request its own tree (off), each tree drafted at the
budget sized for the requests decoding (sized: `opttree.batch_sizing`, serve's default without --budget),
or one node budget a step for the batch (batch-level OPT-Tree), fixed (a number) or chosen from the
target's latency curve measured here first (auto); a --max-batch of 1 runs with the first of them only
(one row a step: how rows share it does not matter).
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import torch
import uvicorn
from transformers import AutoModelForCausalLM, AutoTokenizer

import opttree
from opttree.batch_sizing import SizedBudget, batch_latency
from opttree.bench.prompts import load_prompts
from opttree.calibration.measure import context_ids, latency_curves
from opttree.server.app import GracefulServer, Server, create_app
from opttree.server.load import metric_totals, server_account
from opttree.step.policies.batch import BatchBudget


def serve(server: Server) -> tuple[str, GracefulServer, threading.Thread]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = GracefulServer(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"), server, 5)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", uv, thread


def load(url: str, prompts: list[str], clients: int, max_tokens: int, temperature: float = 0.0,
         seeded: bool = True, logprobs: int | None = None) -> tuple[float, list[float], list[str], int]:
    """Every prompt once, from `clients` threads: (seconds, latencies, answers in prompt order, tokens)."""
    def ask(prompt: str) -> tuple[float, str, int]:
        began = time.perf_counter()
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if seeded:  # sampled: each prompt its own seed, the same in every cell
            body["seed"] = prompts.index(prompt)
        out = http.post(url + "/v1/completions", json=body).json()
        return time.perf_counter() - began, out["choices"][0]["text"], out["usage"]["completion_tokens"]

    # one client for every thread, made before the clock starts: making an httpx client costs ~30 ms of CPU (its
    # TLS context), which a client per request would add to every latency and take from the server's cores
    http = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=clients))
    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool, http:
        results = list(pool.map(ask, prompts))
    return time.perf_counter() - began, [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--batches", default="1,8", help="--max-batch values to compare")
    parser.add_argument("--batch-budgets", default="off", help="off, sized, auto or node counts (comma-separated)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--logprobs", default="off", help="the requests' logprobs: off or a number of likeliest "
                        "tokens, comma-separated to compare (each a cell of its own)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (default: 0)")
    parser.add_argument("--unseeded", action="store_true", help="sampled requests name no seed (the server picks "
                        "one, and may let them decode plainly under load): their answers differ between cells")
    parser.add_argument("--tree", default="opt", help="the tree policy (ar: plain decoding)")
    parser.add_argument("--drafter", default="recycling+lookup")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--target", help="a model folder (default: the shipped target)")
    parser.add_argument("--draft", help="a model folder (default: the shipped draft)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target, draft, tok = opttree.demo_models(dtype)
    if args.target or args.draft:
        from_folder = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()  # noqa: E731
        target = from_folder(args.target) if args.target else target
        draft = from_folder(args.draft) if args.draft else draft
        tok = AutoTokenizer.from_pretrained(args.target) if args.target else tok
    target, draft = target.to(args.device), draft.to(args.device)
    prompts = [p.text for p in load_prompts(args.prompts, limit=args.limit)]
    options = dict(tree=args.tree, drafter=args.drafter, budget=args.budget) if args.tree != "ar" else dict(tree="ar")
    allocators = {"off": None}
    for choice in args.batch_budgets.split(","):
        if choice == "auto":
            top = max(map(int, args.batches.split(","))) * (args.budget + 1)
            ids = tok(prompts[0], return_tensors="pt").input_ids.to(args.device)
            curve = latency_curves({"target": target}, context_ids([ids[0]], 200), top, repeats=3)["target"]
            allocators[choice] = BatchBudget(curve=curve)
        elif choice == "sized":
            allocators[choice] = SizedBudget(batch_latency(target, max(map(int, args.batches.split(",")))))
        elif choice != "off":
            allocators[choice] = BatchBudget(fixed=int(choice))
    named = args.batch_budgets.split(",")
    servers = {(b, name): serve(Server(target, draft if "model" in args.drafter else None, tok, options,
                                       model_name="demo", max_batch=b, max_queue=64, batch_budget=allocator))
               for b in map(int, args.batches.split(",")) for name, allocator in allocators.items()
               if name in (named if b > 1 else named[:1])}  # one row a step: how rows share it does not matter
    reference, table = None, {}
    asked = [None if v == "off" else int(v) for v in args.logprobs.split(",")]
    for _ in range(args.rounds):
        for b, (url, _, _) in servers.items():
            for clients in map(int, args.clients.split(",")):
                for logprobs in asked:
                    before = metric_totals(url)
                    seconds, latencies, answers, tokens = load(url, prompts, clients, args.max_tokens,
                                                               args.temperature, not args.unseeded, logprobs)
                    reference = reference or answers
                    account = server_account(before, metric_totals(url))
                    table.setdefault((b, clients, logprobs), []).append((
                        tokens / seconds, latencies, answers == reference, seconds, account["step_s"],
                        account["rows_per_step"], account["prefill_s_per_request"],
                        account["accepted_per_request_step"]))
    method = f"{args.tree}:{args.drafter}@{args.budget}" if args.tree != "ar" else "plain decoding"
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, temperature {args.temperature:g}, {method}, "
          f"{args.dtype} on {args.device}, {args.rounds} rounds (tokens/s: mean of rounds)")
    print("| --max-batch | --batch-budget | clients | logprobs | tokens/s | p50 latency s | p99 latency s | wall s | in steps s "
          "| rows a step | prefill s a request | accepted a request a step | answers equal |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for ((b, budget), clients, logprobs), runs in table.items():
        lat = np.concatenate([r[1] for r in runs])
        wall, steps, rows, prefill, accepted = (np.mean([r[i] for r in runs]) for i in range(3, 8))
        print(f"| {b} | {budget} | {clients} | {'off' if logprobs is None else logprobs} | "
              f"{np.mean([r[0] for r in runs]):.1f} | {np.percentile(lat, 50):.2f} | "
              f"{np.percentile(lat, 99):.2f} | {wall:.2f} | {steps:.2f} | {rows:.2f} | {prefill:.3f} | "
              f"{accepted:.2f} | "
              f"{all(r[2] for r in runs) if args.dtype in ('float32', 'fp32') else '-'} |")
    for _, uv, thread in servers.values():
        uv.should_exit = True
        thread.join(10)


if __name__ == "__main__":
    main()
