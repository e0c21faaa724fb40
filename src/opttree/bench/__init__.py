"""Benchmark harness: opttree's tree policies and transformers' peers, side by side, measured alike.

`opttree bench` (prompts, methods, runner, report) and `opttree calibrate` (hardware-aware budget,
`--budget auto`).
"""

from ..profiles import auto_settings
from .calibrate import run_calibration
from .methods import MethodSpec, Settings, expand_methods, method_table
from .prompts import Prompt, load_prompts
from .report import summarize
from .runner import prepare, run_bench

__all__ = ["auto_settings", "run_calibration", "MethodSpec", "Settings", "expand_methods", "method_table", "Prompt",
           "load_prompts", "summarize", "prepare", "run_bench"]
