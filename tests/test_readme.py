"""Every command and Python snippet in README.md, docs/USAGE.md and docs/METHODS.md runs, with small sizes, so
that they cannot go stale.

What is run: each ```bash / ```sh / ```console block (a line is a command; `\\` continues it; `&&` splits
it into parts run in order) and each ```python block. Untagged ``` blocks are synopses (`[--flag X]`),
not commands, and are not run. Before running, every command and snippet goes through SUBSTITUTIONS
(smaller sizes, temporary output folders, a free port); a part that matches SKIPPED is not run, and
the reason is in the table. `opttree ...` commands run in-process through `opttree.cli.main` (a
non-zero exit fails the test); other commands (pipes, curl) run in bash with `opttree` replaced by
this Python's `-m opttree.cli`. `opttree serve` is started once, in a subprocess, for the snippets
that talk to it (they name 127.0.0.1:8000), and stopped at the end.
"""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from opttree.cli import main
from opttree.demo import demo_paths

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "docs" / "USAGE.md", ROOT / "docs" / "METHODS.md"]  # whose commands and snippets run
SHELL_TAGS = ("bash", "sh", "console")
SERVER_ADDRESS = "127.0.0.1:8000"  # the README's clients name this address: they need the server

# (pattern, replacement) applied in order to every command and snippet: small sizes, nothing written
# to the repository. {out}, {port}, {target}, {draft}, {head}, {early_exit}, {length} are filled in per run.
SUBSTITUTIONS = [
    (r"--max-new-tokens \d+", "--max-new-tokens 8"),                      # generation length
    (r"max_new_tokens=\d+", "max_new_tokens=8"),
    (r"(opttree\.Speculator\([^)]*)\)", r"\1, max_new_tokens=8)"),    # a speculator's requests: 8 tokens too
    (r"max_tokens=\d+", "max_tokens=8"),                                  # OpenAI clients
    (r'"max_tokens": \d+', '"max_tokens": 8'),
    (r"opttree demo(?!\S)", "opttree demo --max-new-tokens 8"),
    (r"opttree generate (?!.*--max-new-tokens)", "opttree generate --max-new-tokens 8 "),  # its default is 128
    (r"--budgets [\d,auto]+", "--budgets 4"),                             # bench: one budget,
    (r"opttree bench ", "opttree bench --limit 1 "),                      # one prompt
    (r"opttree calibrate (?!--quick)", "opttree calibrate --quick "),     # calibrate: the quick mode, smaller still
    (r"opttree calibrate ", "opttree calibrate --limit 1 --max-tokens 4 --repeats 1 --context 16 --max-new-tokens 8 "
                            "--budgets 2 --deltas 0.6 --no-progress "),
    (r"--out runs/", "--out {out}/runs/"),                                # outputs in a temporary folder
    (r"runs/head/final", "{head}"),                                       # an untrained head stands for yours,
    (r"runs/early-exit/final", "{early_exit}"),                           # an untrained exit layer,
    (r"runs/length/final", "{length}"),                                   # an untrained length predictor
    (r"(?<=opttree calibrate )(?!.*--out)", "--out {out}/calibration "),  # calibrate writes ./calibration by default
    (r"--port 8000", "--port {port}"),
    (re.escape(SERVER_ADDRESS), "127.0.0.1:{port}"),
    (r"path/to/target", "{target}"),                                      # the shipped pair stands for "your models"
    (r"path/to/draft", "{draft}"),
]

# A command part matching one of these patterns is not run, for the reason given.
SKIPPED = {
    r"^pip install": "installs packages from the network; the test runs against the installed package",
    r"^python -m pytest": "the whole test suite (minutes); this test is part of it",
    r"^opttree train pair": "trains the shipped pair from scratch (its defaults: 70 + 20 minutes of training); "
                            "tests/test_train.py trains tiny models",
    r"^opttree train head": "trains a head (minutes: the target writes its text first); tests/test_head.py trains one",
    r"^opttree train early-exit": "trains an exit layer (minutes: the target writes its text first); tests/test_train.py "
                                  "runs the command on a tiny target",
    r"^opttree train length-predictor": "logs minutes of runs; tests/test_train.py runs the command on a tiny target",
    r"^torchrun ": "starts several ranks of a sharded target; tests/test_parallel.py runs generate, bench and serve "
                   "with --tp under torchrun",
    r"^python -m http.server|^nginx": "a stand-in for a load balancer; tests/test_fleet.py puts two replicas behind "
                                      "a round-robin proxy",
}
NEEDS_TORCHRUN = r"tp_plan=|DistributedConfig"  # a snippet that shards a model runs under torchrun only
NEEDS_GPU = r"--device cuda|\.cuda\(\)|\.to\(\"cuda\"\)"  # skipped without CUDA


def blocks(text: str) -> list[tuple[str, str]]:
    """(tag, body) of every fenced block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)


def shell_commands(body: str, tag: str) -> list[str]:
    """One string per command: continuation lines joined, console prompts (`$ `) removed, blank lines dropped."""
    lines = body.replace("\\\n", " ").splitlines()
    if tag == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def readme_items(text: str) -> list[tuple[str, str]]:
    """("shell", part) for each `&&` part of each command, ("python", snippet) for each snippet, in page order."""
    items = []
    for tag, body in blocks(text):
        if tag in SHELL_TAGS:
            for command in shell_commands(body, tag):
                items += [("shell", part.strip()) for part in command.split(" && ")]
        elif tag == "python":
            items.append(("python", body))
    return items


def page_items(pages: list[Path]) -> list[tuple[str, str, str]]:
    """(page name, kind, text) for every item of every page, pages in order."""
    return [(page.stem, kind, text) for page in pages for kind, text in readme_items(page.read_text(encoding="utf-8"))]


def substitute(text: str, **values) -> str:
    for pattern, replacement in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text)
    for name, value in values.items():
        text = text.replace("{" + name + "}", str(value))
    return text


def skip_reason(kind: str, text: str) -> str | None:
    if kind == "shell":
        for pattern, reason in SKIPPED.items():
            if re.search(pattern, text):
                return reason
    if kind == "python" and re.search(NEEDS_TORCHRUN, text):
        return "a sharded target runs under torchrun; tests/tp_worker.py does the same in tests/test_parallel.py"
    if re.search(NEEDS_GPU, text) and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


def run_shell(command: str) -> None:
    """An `opttree` command in-process, anything else in bash; fails on a non-zero exit."""
    words = shlex.split(command, comments=True)
    if words[0] == "opttree" and not re.search(r"[|;<>]|\$\(", command):
        status = main(words[1:])
        assert status == 0, f"`{command}` exited with {status}"
        return
    command = re.sub(r"(^|[|;&]\s*)opttree ", rf"\1{sys.executable} -m opttree.cli ", command)
    done = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"`{command}` exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PAGE_ITEMS = page_items(PAGES)
ITEMS = [(kind, text) for _, kind, text in PAGE_ITEMS]


@pytest.fixture(scope="module")
def values(tmp_path_factory):
    from opttree.step.drafters.early_exit import ExitLayer
    from opttree.step.drafters.head import FeatureHead, head_config
    from opttree.step.length import LengthPredictor
    from opttree.train.distill import load_target

    target, draft = demo_paths()
    out = tmp_path_factory.mktemp("readme-out")
    shipped = load_target(target)  # a random head for the shipped target: exact output, a head's cost
    head = FeatureHead(head_config(shipped)).save(out / "head", shipped)
    early_exit = ExitLayer(shipped, 2).save(out / "early-exit", shipped)
    length = LengthPredictor(shipped.config.hidden_size, 8).save(out / "length", shipped)
    return dict(out=out, port=free_port(), target=target, draft=draft, head=head, early_exit=early_exit, length=length)


@pytest.fixture(scope="module")
def server(values):
    """The README's `opttree serve` command, in a subprocess, until the module's tests are done."""
    serve = [text for kind, text in ITEMS if kind == "shell" and text.startswith("opttree serve")]
    assert len(serve) == 1, f"expected one `opttree serve` command in {[p.name for p in PAGES]}, found {serve}"
    words = shlex.split(substitute(serve[0], **values), comments=True)
    process = subprocess.Popen([sys.executable, "-m", "opttree.cli", *words[1:]], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{values['port']}/health"
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"`{serve[0]}` exited with {process.returncode}:\n{process.stderr.read()}")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"`{serve[0]}` did not answer {url} within 60 s")
            time.sleep(0.2)
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def readme_env(monkeypatch, values):
    """The commands write profiles and caches to a temporary folder, never the user's."""
    monkeypatch.setenv("OPTTREE_CACHE_DIR", str(values["out"] / "cache"))


def test_the_readme_has_commands_and_snippets():
    kinds = [kind for page, kind, _ in PAGE_ITEMS if page == "README"]
    assert kinds.count("shell") >= 8 and kinds.count("python") >= 2, PAGE_ITEMS  # the extraction found them
    assert {page for page, _, _ in PAGE_ITEMS} == {page.stem for page in PAGES}  # and every page has some


@pytest.mark.parametrize("kind, text", ITEMS, ids=[f"{i}-{page}-{kind}-{'_'.join(text.split()[:2])}"
                                                    for i, (page, kind, text) in enumerate(PAGE_ITEMS)])
def test_readme_item_runs(kind, text, values, readme_env, request):
    reason = skip_reason(kind, text)
    if reason:
        pytest.skip(reason)
    if text.startswith("opttree serve") or SERVER_ADDRESS in text:
        request.getfixturevalue("server")
        if text.startswith("opttree serve"):
            return  # it answered /health
    runnable = substitute(text, **values)
    if kind == "shell":
        run_shell(runnable)
    else:
        exec(compile(runnable, "README.md python block", "exec"), {"__name__": "__readme__"})


def test_a_broken_command_fails(values, readme_env):
    """The runner is not blind: a README command with a mistake in it fails."""
    with pytest.raises((AssertionError, SystemExit)):
        run_shell(substitute("opttree demo --max-new-tokens 12 --no-such-flag", **values))
    with pytest.raises(AssertionError):
        run_shell("echo opttree | grep no-such-text")  # the bash path too
