"""`opttree serve`: an OpenAI-compatible HTTP server (the app is in `opttree.server.app`, imported
only when the command runs, so that `opttree --help` stays fast)."""

from __future__ import annotations


def cmd_serve(args) -> int:
    import uvicorn

    from ..bench.calibrate import calibrate_first
    from ..flags import load_pair, tree_options, used_draft
    from .app import Server, create_app

    target, draft, tokenizer = load_pair(args)
    calibrate_first(args, target, draft, tokenizer)  # a pair new to this machine, default settings
    options = tree_options(args, target, draft)
    server = Server(target, used_draft(options, draft), tokenizer, options,
                    model_name=args.model_name or (args.target or "opttree-demo"), max_queue=args.max_queue)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="info")
    return 0


def register(subparsers) -> None:
    from ..flags import add_decoding_args, add_tree_args

    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                              "/v1/chat/completions, /v1/models, /health, /metrics)")
    add_decoding_args(p)
    add_tree_args(p)
    p.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    p.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: --target)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting or running before 429 (default: 16)")
    p.set_defaults(func=cmd_serve)
