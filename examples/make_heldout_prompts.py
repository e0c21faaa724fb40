"""Write examples/heldout-code.jsonl: code prompts the shipped pair never trained on.

The shipped models were trained on the Python standard library except the held-out packages
(`opttree.train.corpus.HELDOUT_MODULES`: email, html, http, json, logging, urllib, wsgiref, xml).
Each prompt is a function from one of them, from its `def` line through its docstring, to be
continued (HumanEval's format: task_id, prompt, category). Three per package, the first documented
functions in sorted file order. Run: python examples/make_heldout_prompts.py (CPython 3.11.7 made the
committed file).
"""

import ast
import json
import sysconfig
from pathlib import Path

from opttree.train.corpus import HELDOUT_MODULES

PER_PACKAGE = 3
OUT = Path(__file__).with_name("heldout-code.jsonl")


def documented_functions(path: Path):
    source = path.read_text(encoding="utf-8", errors="ignore")
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and len(node.body) > 1:
            doc = node.body[0]
            yield node.name, "".join(lines[node.lineno - 1 : doc.end_lineno]).rstrip() + "\n"


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for package in sorted(HELDOUT_MODULES):
        files = sorted(stdlib.glob(f"{package}/**/*.py")) or [stdlib / f"{package}.py"]
        found = []
        for path in files:
            for name, prompt in documented_functions(path):
                if len(prompt) < 1500 and not prompt.startswith((" ", "\t")):  # top-level functions
                    found.append({"task_id": f"heldout/{path.relative_to(stdlib)}:{name}", "prompt": prompt,
                                  "category": package})
        rows += found[:PER_PACKAGE]
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
