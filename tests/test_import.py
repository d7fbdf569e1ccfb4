"""The planning core starts fast and runs anywhere: `import pipeloom` pulls in no torch and no matplotlib."""

import subprocess
import sys


def imported_modules(statement: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", statement], capture_output=True, text=True, check=True
    )
    return {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}


def test_import_pipeloom_imports_no_torch_or_matplotlib():
    modules = imported_modules("import pipeloom; pipeloom.simulate(pipeloom.build_schedule('chimera', 4, 4))")
    assert "pipeloom" in modules
    assert not {m for m in modules if m.split(".")[0] in ("torch", "matplotlib", "numpy", "ortools")}


def test_cli_simulate_without_plot_imports_no_matplotlib():
    modules = imported_modules(
        "from pipeloom.cli import main; main(['simulate', '1f1b', '-p', '2', '-m', '2', '--json'])"
    )
    assert not {m for m in modules if m.split(".")[0] in ("torch", "matplotlib", "ortools")}
