"""Benchmark harness: opttree's tree policies and transformers' peers, side by side, measured alike.

`opttree bench` (prompts.py, methods.py, runner.py, report.py, cli.py) and `opttree calibrate`
(calibrate.py: hardware-aware budget, `--budget auto`). Import the submodules; this package imports
nothing, so that building the CLI's parsers stays free of torch.
"""
