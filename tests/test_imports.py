"""The package's modules import each other without a cycle: every module sits above the ones it uses.

The graph is read from the source with `ast`: `import opttree.x` and `from .x import y` statements at
module level and inside functions alike (a lazy import is still a dependency), and string literals
that name a module exactly (`__import__(name)` over a list of command modules). Importing
`opttree.a.b` runs the package `opttree.a` first, so a module outside `opttree.a` depends on it too.
"""

import ast
from pathlib import Path

import opttree

SRC = Path(opttree.__file__).parent


def module_names() -> dict[str, Path]:
    """{'opttree.calibration.run': path, ...}; a package by its __init__.py."""
    names = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("opttree",) + path.relative_to(SRC).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_names(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every dotted name `module` imports (absolute): `from a import b` imports the module a.b if
    there is one, else a name from a (a dependency on a's code)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` in opttree.a.b is opttree.x
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{node.module}" if node.module else anchor
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("opttree."):
            found.add(node.value)
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: the package modules it imports}, and the ancestor packages it lies outside of."""
    modules = module_names()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in imported_names(module, path, modules):
            if name not in modules:
                continue
            parts = name.split(".")
            for i in range(2, len(parts) + 1):  # opttree.a, opttree.a.b, ...: each runs when name is imported
                target = ".".join(parts[:i])
                if target == name or not (module == target or module.startswith(target + ".")):
                    edges.add(target)
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list [a, b, ..., a] of modules importing each other in turn, or None (depth-first search)."""
    state = {}  # module -> "open" while on the current path, "done" once all it reaches is acyclic
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for child in sorted(graph[module]):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "opttree.flags" in graph["opttree.bench.cli"]  # `from ..flags import ...` inside a function
    assert "opttree.bench.cli" in graph["opttree.cli"]  # registered by name: `__import__(module)`
    assert "opttree.bench" in graph["opttree.cli"]  # ... which runs opttree/bench/__init__.py first
    assert "opttree.step.policies.sequoia" in graph["opttree.profiles"]  # `from .step.policies import sequoia`
    assert "opttree.step.policies" in graph["opttree.profiles"]  # the package's __init__ runs first
    assert "opttree.bench" not in graph["opttree.bench.cli"]  # `from . import report`: only the submodule
    assert "opttree.step.policies.registry" in graph["opttree.step.policies.static"]


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cli_help_imports_no_torch():
    """`opttree --help` and every command's --help build their parsers without importing torch (~0.2 s, not ~7)."""
    import subprocess
    import sys

    for command in ([], ["generate"], ["bench"], ["calibrate"], ["serve"], ["train"], ["demo"]):
        code = ("import sys; from opttree.cli import build_parser\n"
                f"try: build_parser().parse_args({command + ['--help']!r})\n"
                "except SystemExit: pass\n"
                "assert 'torch' not in sys.modules, 'torch imported'")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr[-500:])


def test_the_torch_free_name_lists_match_the_registries():
    from opttree.quantize import SCHEMES
    from opttree.settings.drafter_spec import KINDS
    from opttree.settings.names import BUILTIN_POLICIES, BUILTIN_SOURCE_KINDS, BUILTIN_SOURCES, QUANTIZATIONS
    from opttree.step.drafters.sources import available_sources
    from opttree.step.policies import available

    assert list(BUILTIN_POLICIES) == available() and list(BUILTIN_SOURCES) == available_sources()
    assert {name: KINDS[name] for name in BUILTIN_SOURCES} == BUILTIN_SOURCE_KINDS  # registered as declared
    assert sorted(QUANTIZATIONS) == sorted(SCHEMES)


def test_the_layers_point_down():
    """settings <- the step's stages <- the engine and everything above: the settings import no stage and
    nothing above; the stages import the settings and the model plumbing below them (where a model lives,
    trained parts' files, tensor parallelism, thread settings, packed linear weights), never the engine, a front
    end or calibration."""
    plumbing = {"opttree.device", "opttree.parts", "opttree.parallel", "opttree.threads", "opttree.packed"}
    graph = import_graph()
    for module, imported in graph.items():
        imported = imported - {"opttree"}  # the package itself runs first for every module
        if module.startswith("opttree.settings"):
            assert all(name.startswith("opttree.settings") for name in imported), (module, imported)
        if module.startswith("opttree.step"):
            above = {name for name in imported if not name.startswith(("opttree.step", "opttree.settings"))}
            assert above <= plumbing, (module, above - plumbing)
        if module in plumbing:
            assert not any(name.startswith("opttree.step") for name in imported), module
