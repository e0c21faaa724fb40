"""What a step costs on a GPU, method by method: wall time, kernels launched and GPU busy fraction per step.

python scripts/gpu_step_profile.py --target DIR --draft DIR [--methods ar,opt@16,...] [--compiled ar,...]

A method is `POLICY[:DRAFTER][@BUDGET]`, with `!host` or `!device` to decide OPT-Tree's delta stop (and
DySpec's growth) there (default: the host, a read per draft layer; `!device` drafts every layer to max_depth
and reads nothing until the acceptance: `opt@16!device` against `opt@16`, `dyspec@16!device`).

Each method (`POLICY[:DRAFTER][@BUDGET]`) generates --max-new-tokens tokens from one HumanEval-style
prompt, greedy: one warm-up, one timed run (wall time per step, tokens/s, mean accepted length), one
run under torch.profiler (CUDA kernels, memcpys and memsets per step; their summed device time). GPU busy =
device time / the timed run's wall time (the profiled run's own wall time is inflated by the profiler).
The methods of --compiled then run again on the compiled fixed-shape steps (`compile_model`: the
target's and the draft's, CUDA graphs), after a warm-up that compiles them (its time is printed).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

import opttree
from opttree.step.policies.dyspec import DySpec
from opttree.step.policies.opt import OptTree

PROMPT = 'def binary_search(items, target):\n    """Return the index of target in items, or -1."""\n'


def parse(method: str) -> dict:
    """'POLICY[:DRAFTER][@BUDGET][!host|!device]' -> generate's keyword arguments, and where OPT-Tree's delta
    stop is decided ('stop': host = a read per draft layer, device = every layer drafted; default: the
    engine's choice, the host)."""
    method, _, stop = method.partition("!")
    if stop not in ("", "host", "device"):
        raise SystemExit(f"{method}!{stop}: the stop is decided on the host or the device")
    name, _, budget = method.partition("@")
    policy, _, drafter = name.partition(":")
    return dict(tree=policy, **({"drafter": drafter} if drafter else {}), **({"budget": int(budget)} if budget else {}),
                stop=stop)


def run(target, draft, ids, kwargs, max_new_tokens):
    kwargs = dict(kwargs)
    stop = kwargs.pop("stop")
    uses_draft = kwargs["tree"] != "ar" and "model" in kwargs.get("drafter", "model")
    OptTree.stop_on_device = DySpec.grow_on_device = stop == "device"
    try:
        return opttree.generate(target, ids, draft if uses_draft else None, max_new_tokens=max_new_tokens,
                                eos_token_id=[], **kwargs)
    finally:
        OptTree.stop_on_device = DySpec.grow_on_device = False


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(target, draft, ids, method: str, max_new_tokens: int) -> dict:
    kwargs = parse(method)
    run(target, draft, ids, kwargs, max_new_tokens)  # warm-up: the same capacity buckets as the timed run
    sync()
    start = time.perf_counter()
    out = run(target, draft, ids, kwargs, max_new_tokens)
    sync()
    wall = time.perf_counter() - start
    s = out.stats  # greedy: the profiled run takes the same steps
    row = {"method": method, "tokens/s": s.new_tokens / wall, "MAL": s.mean_accepted_length,
           "ms/step": 1000 * wall / s.steps, "kernels/step": float("nan"), "GPU busy %": float("nan")}
    if ids.device.type != "cuda":  # nothing to count off a GPU
        return row
    # device activity only: a CPU trace of 128 tokens holds too many events to read in time
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        profiled = run(target, draft, ids, kwargs, max_new_tokens)
        sync()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_s = sum(e.time_range.elapsed_us() for e in device) / 1e6
    assert torch.equal(profiled.sequences, out.sequences)
    return row | {"kernels/step": len(device) / s.steps, "GPU busy %": 100 * busy_s / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default="ar,opt@16,opt@64,opt:recycling+lookup@16,opt:recycling+lookup@64")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--compiled", default="", help="methods to run again on the compiled step (comma-separated)")
    parser.add_argument("--device", default="cuda", help="(cpu: to try the script; no kernels to count there)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(args.device)
    target, draft = load(args.target), load(args.draft)
    ids = AutoTokenizer.from_pretrained(args.target)(PROMPT, return_tensors="pt").input_ids.to(args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{device}, {args.dtype}, {args.max_new_tokens} new tokens, one code prompt, greedy")
    print("| method | tokens/s | MAL | ms/step | kernels/step | GPU busy % |\n|---|---:|---:|---:|---:|---:|", flush=True)
    for m in filter(None, args.methods.split(",")):  # each row as soon as it is measured: a run cut short keeps its rows
        show(measure(target, draft, ids, m, args.max_new_tokens))
    if args.compiled:
        opttree.compile_model(target)
        opttree.compile_model(draft)
        for m in filter(None, args.compiled.split(",")):
            start = time.perf_counter()
            run(target, draft, ids, parse(m), args.max_new_tokens)
            print(f"compile + capture of {m}+compile: {time.perf_counter() - start:.1f} s", flush=True)
            show(measure(target, draft, ids, m, args.max_new_tokens) | {"method": m + "+compile"})


def show(r: dict) -> None:
    print(f"| {r['method']} | {r['tokens/s']:.1f} | {r['MAL']:.2f} | {r['ms/step']:.2f} | {r['kernels/step']:.0f} "
          f"| {r['GPU busy %']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
