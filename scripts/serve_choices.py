"""`opttree serve` with n sampled choices in one request (n rows of the batch) against the same n requests one
after another and from n concurrent clients: tokens/s, interleaved round by round (3 rounds).

    python scripts/serve_choices.py [bfloat16|float32]

Four HumanEval prompts, 8 choices of 64 tokens each at temperature 1 (seeded), the shipped target with the
train-free sources (`opt:recycling+lookup@16`), `--max-batch 8`."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

sys.path.insert(0, os.path.dirname(__file__))
import opttree  # noqa: E402
from opttree.bench.prompts import load_prompts  # noqa: E402
from opttree.server.app import Server  # noqa: E402
from serve_throughput import serve  # noqa: E402

N, TOKENS = 8, 64  # choices a request, tokens a choice


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    target, _, tok = opttree.demo_models(dtype)
    url, uv, _ = serve(Server(target, None, tok, dict(tree="opt", drafter="recycling+lookup", budget=16),
                              model_name="demo", max_batch=8, max_queue=64))
    prompts = [p.text for p in load_prompts("../shared/data/humaneval.jsonl", limit=4)]
    http = httpx.Client(timeout=600)

    def ask(prompt: str, seed: int, n: int) -> int:
        body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 1.0, "seed": seed, "n": n}
        return http.post(url + "/v1/completions", json=body).json()["usage"]["completion_tokens"]

    def concurrent(prompt: str) -> int:
        with ThreadPoolExecutor(N) as pool:
            return sum(pool.map(lambda i: ask(prompt, i, 1), range(N)))

    ways = {f"n={N} in one request": lambda: sum(ask(p, 0, N) for p in prompts),
            f"{N} requests one after another": lambda: sum(ask(p, i, 1) for p in prompts for i in range(N)),
            f"{N} concurrent clients": lambda: sum(map(concurrent, prompts))}
    ask(prompts[0], 0, 2)  # warm-up
    rates: dict[str, list[float]] = {}
    for _ in range(3):
        for name, way in ways.items():
            began = time.perf_counter()
            tokens = way()
            rates.setdefault(name, []).append(tokens / (time.perf_counter() - began))
    print("| requests | tokens/s (mean) | rounds |\n|---|---:|---|")
    for name, values in rates.items():
        print(f"| {name} | {sum(values) / len(values):.1f} | {' / '.join(f'{v:.1f}' for v in values)} |")
    uv.should_exit = True


if __name__ == "__main__":
    main()
