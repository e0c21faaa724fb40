"""Benchmark harness: opttree's tree policies and transformers' peers, side by side, measured alike.

`opttree bench` (prompts.py, methods.py, runner.py, report.py, cli.py) and the `opttree calibrate`
command (cli.py; what it measures and chooses is the library's: `opttree.calibration`). Import the
submodules; this package imports nothing, so that building the CLI's parsers stays free of torch.
"""
