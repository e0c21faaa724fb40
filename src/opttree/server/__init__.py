"""`opttree serve`: an OpenAI-compatible HTTP server (the app is in `opttree.server.app`, imported
only when the command runs, so that `opttree --help` stays fast)."""

from __future__ import annotations


def cmd_serve(args) -> int:
    import argparse

    import uvicorn

    from .. import parallel
    from ..calibration import calibrate_first
    from ..flags import load_pair, resolved_tree_options, used_draft
    from . import ranks
    from .app import GracefulServer, Limits, Server, create_app

    target, draft, tokenizer = load_pair(args)
    calibrate_first(args, target, draft, tokenizer)  # a pair new to this machine, default settings
    # a sharded target decodes one request at a time (`ranks`): its requests share no step
    allocator = None if args.tp else batch_budget(args.batch_budget, target, draft, args.max_batch,
                                                  args.budget is not None)
    # greedy and sampled requests each get the settings chosen for them (the profile measures both)
    greedy, sampled = (resolved_tree_options(argparse.Namespace(**{**vars(args), "temperature": t}), target, draft)
                       for t in (0.0, 1.0))
    draft = draft if used_draft(greedy, draft) or used_draft(sampled, draft) else None
    if args.tp and not parallel.is_main():  # a sharded target's other ranks: rank 0's requests, step by step
        return ranks.follow(target, draft, tokenizer)
    leader = ranks.Leader(target, draft, tokenizer) if args.tp else None
    defaults = Limits.for_device(target.device.type, max(o.get("budget") or 0 for o in (greedy, sampled)),
                                 max(o.get("max_depth") or 0 for o in (greedy, sampled)))
    limits = Limits(args.max_budget or defaults.max_budget, args.max_tree_depth or defaults.max_depth)
    server = Server(target, draft, tokenizer, greedy, model_name=args.model_name or (args.target or "opttree-demo"),
                    max_queue=args.max_queue, sampled_options=sampled, leader=leader, limits=limits,
                    max_batch=args.max_batch, batch_budget=allocator)
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_grace + 5)
    try:
        GracefulServer(config, server, args.shutdown_grace).run()  # releases the other ranks when it stops
    finally:
        server.stopped()  # also when it failed to start
    return 0


def batch_budget(choice: str | None, target, draft, max_batch: int, budget_given: bool):
    """--batch-budget: 'sized' (the default without --budget) -> each greedy request's tree drafted, each step, at
    the budget sized for the requests decoding together (`opttree.batch_sizing`: this target's batch forward,
    timed once on this machine); 'off' (the default with --budget) -> None, each request its own tree;
    N -> that many nodes a step for the batch; 'auto' -> chosen each step from the pair's measured latency
    curve (its calibration profile), None without one."""
    from ..batch_sizing import SizedBudget, batch_latency
    from ..profiles import find_profile, load_profile
    from ..step.chains import verified_as_chains
    from ..step.policies.batch import BatchBudget

    choice = choice or ("off" if budget_given else "sized")
    if choice == "off" or max_batch < 2 or verified_as_chains(target):  # chains: decoded one at a time
        return None
    if choice == "sized":
        latency = batch_latency(target, max_batch)
        return SizedBudget(latency) if latency is not None else None
    if choice != "auto":
        return BatchBudget(fixed=int(choice))
    curve = (load_profile(target, draft).get("latency") or {}).get("target_s") if draft is not None and \
        find_profile(target, draft) is not None else None
    if not curve:
        print("opttree serve: no measured latency curve for this pair (`opttree calibrate`): --batch-budget auto "
              "is off, each request keeps its own tree")
        return None
    return BatchBudget(curve=curve)


def batch_budget_arg(text: str) -> str:
    import argparse

    if text in ("auto", "off", "sized") or text.isdigit():
        return text
    raise argparse.ArgumentTypeError(f"must be sized, auto, off or a number of nodes >= 0, got {text!r}")


def cmd_load_test(args) -> int:
    from .load import cmd_load_test as run

    return run(args)


def positive_int(text: str) -> int:
    import argparse

    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def register(subparsers) -> None:
    from ..flags import add_decoding_args, add_tp_arg, add_tree_args

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                              "/v1/chat/completions, /v1/models, /health, /metrics)")
    add_decoding_args(p)
    add_tree_args(p)
    p.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    p.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: --target)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting or running before 429 (default: 16)")
    p.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="requests decoding together at most (continuous batching: they join and leave between "
                        "steps; the others wait in arrival order; default: 8; a --tp target decodes one at a time)")
    p.add_argument("--batch-budget", type=batch_budget_arg, metavar="sized|auto|off|N",
                   help="how requests decoding together share a step. sized: each request's tree drafted at the "
                        "budget that makes the batch's tokens/s largest for the number decoding now (this target's "
                        "batch forward is timed once on this machine); off: each request its own tree; N / auto: "
                        "batch-level OPT-Tree, one node budget a step for all of them, given to the candidates most "
                        "likely accepted whichever request they belong to (auto: chosen each step from the pair's "
                        "calibrated latency curve) (default: sized, off with --budget)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on Ctrl-C / SIGTERM, requests in flight or queued may finish for this long; then they end "
                        "with an error (default: 30)")
    p.add_argument("--max-budget", type=positive_int, metavar="N",
                   help="the largest `budget` a request may ask (draft nodes per step); past it, a 400 naming this "
                        "limit (default: 256 on a GPU, 64 on a CPU, at least the server's own budget)")
    p.add_argument("--max-tree-depth", type=positive_int, metavar="N",
                   help="the largest `max_depth` a request may ask (draft layers per step; default: 64, at least "
                        "the server's own)")
    add_tp_arg(p)
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("load-test", help="a bounded load test of a running server: concurrent clients "
                              "mixing plain, streamed, cancelled and malformed requests; every answer checked")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root (default: %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    p.add_argument("--requests", type=int, default=20, help="requests per client (default: 20)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer: this, +1 or +2 (default: 8)")
    p.add_argument("--cancel-tokens", type=int, default=64,
                   help="max_tokens of the streams abandoned after their first event (default: 64)")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    p.set_defaults(func=cmd_load_test)
