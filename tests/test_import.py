"""The planning core starts fast and runs anywhere: `import pipeloom` pulls in no torch and no matplotlib."""

import subprocess
import sys


def imported_modules(*statements: str) -> list[set[str]]:
    """The modules loaded by each statement in turn, in one fresh interpreter (what each added to
    those before it): one interpreter's start-up for all."""
    marker = "-- next statement --"
    script = "\n".join(f"{statement}\nprint({marker!r}, file=__import__('sys').stderr)" for statement in statements)
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", script], capture_output=True, text=True, check=True
    )
    parts = result.stderr.split(marker)[: len(statements)]
    return [{line.rsplit("|", 1)[-1].strip() for line in part.splitlines() if "|" in line} for part in parts]


def test_the_planning_core_and_the_cli_import_no_torch_or_matplotlib():
    core, cli = imported_modules(
        "import pipeloom; pipeloom.simulate(pipeloom.build_schedule('chimera', 4, 4))",
        "from pipeloom.cli import main; main(['simulate', '1f1b', '-p', '2', '-m', '2', '--json'])",
    )
    assert "pipeloom" in core and "pipeloom.cli" in cli
    assert not {m for m in core if m.split(".")[0] in ("torch", "matplotlib", "numpy", "ortools")}
    # `simulate` without a plot: no matplotlib either
    assert not {m for m in cli if m.split(".")[0] in ("torch", "matplotlib", "ortools")}


def module_imports(inside_functions: bool = False) -> dict[str, set[str]]:
    """Module → the pipeloom modules it imports, read from the source: at load time only (lazy
    imports inside functions are deliberate, for start-up time), or anywhere."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "src"
    modules = {}
    for path in (root / "pipeloom").rglob("*.py"):
        name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        found = set()
        for node in ast.walk(tree) if inside_functions else tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeloom"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.startswith("pipeloom")}
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def test_modules_import_each_other_in_one_direction():
    graph = module_imports()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target] if target in path else [module, target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert "pipeloom.sim.engine" not in graph and "pipeloom.ir.walk" in graph["pipeloom.ir.validate"]
    assert not any(m.startswith("pipeloom.sim") for m in graph["pipeloom.ir.validate"])
    assert not {m for m in graph if m.startswith("pipeloom.cli.") and "pipeloom.cli" in graph[m]}


# Layers, bottom up; a package may import its own layer and those below, never one above — at
# load time or inside a function. The planning core imports no torch; models are what the
# runtime trains; the runtime runs plans; the profiler measures with the runtime; the command
# line and the plots sit on top. The profile's typed format sits with the tuner that reads it, below
# the profiler that writes it.
LAYERS = [
    {"errors", "units", "files", "provenance", "ir", "stage_costs", "costs", "static_memory", "budget"},
    {"sim"},
    {"schedules", "passes"},
    {"tune", "profile_format"},
    {"models", "data"},
    {"runtime"},
    {"profile"},
    {"viz", "train", "cli"},
]


def layer_of(module: str) -> int:
    part = module.split(".")[1] if module.count(".") else "__init__"
    for index, layer in enumerate(LAYERS):
        if part in layer:
            return index
    return len(LAYERS)  # the package's own __init__ curates the public API above everything


def test_no_module_imports_a_layer_above_its_own_even_inside_a_function():
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in module_imports(inside_functions=True).items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )
    assert not upward, "imports against the layering: " + ", ".join(upward)


def test_the_models_extra_leaves_transformers_importable_in_user_code():
    """PyPI's torchvision, built for CUDA torch, broke `from transformers import GPT2LMHeadModel`
    in a user's own script next to the CPU torch: `models` no longer brings it (`vision` does),
    and this venv — what `pipeloom[models]` installs — holds no torchvision where a user's script
    finds packages (the tests' own copy lies beside it, on their path only: importing GPT-2 in this
    process fails on it, as it did for users)."""
    import importlib.metadata
    import site

    import pytest

    pytest.importorskip("transformers")
    requires = importlib.metadata.requires("pipeloom") or []
    models = [r for r in requires if 'extra == "models"' in r]
    assert models and not [r for r in models if r.startswith("torchvision")]
    assert [r for r in requires if r.startswith("torchvision") and 'extra == "vision"' in r]
    found = importlib.metadata.distributions(path=site.getsitepackages())
    assert "torchvision" not in {(d.metadata["Name"] or "").lower() for d in found}
