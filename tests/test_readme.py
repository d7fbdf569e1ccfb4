"""The README's commands work as written: every shell block marked `<!-- runnable -->` runs, in
order, in a fresh directory holding only the repository's examples, with the installed
`pipeloom` on PATH (what `. .venv/bin/activate` gives); a block marked `<!-- output -->` is what
the command before it prints. The first block goes through the console script; the rest call
its entry point (`pipeloom.cli.main`) in this process, which spares each command a fresh
interpreter importing torch."""

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"<!-- (runnable|output) -->\n```(\w+)\n(.*?)```", re.S)


def marked_blocks() -> list[tuple[str, str]]:
    return [(mark, body) for mark, _, body in _BLOCK.findall((ROOT / "README.md").read_text())]


def commands(body: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = body.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def run_block(body: str, cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", COLUMNS="200")
    printed = []
    for command in commands(body):
        done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"README command failed: {command}\n{done.stderr[-2000:]}"
        printed.append(done.stdout)
    return "".join(printed)


def run_block_in_process(body: str, monkeypatch) -> str:
    """The block's `pipeloom` commands through the console script's entry point, in this process."""
    from pipeloom.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    printed = []
    for command in commands(body):
        words = shlex.split(command)
        assert words[0] == "pipeloom", f"not a pipeloom command: {command}"
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(words[1:])
        assert code == 0, f"README command failed: {command}\n{err.getvalue()[-2000:]}"
        printed.append(out.getvalue())
    return "".join(printed)


def test_the_readme_marks_its_commands():
    marks = [mark for mark, _ in marked_blocks()]
    assert marks.count("runnable") >= 4 and "output" in marks
    assert all(prev == "runnable" for prev, mark in zip(marks, marks[1:]) if mark == "output")


def test_the_readme_compare_table_is_what_compare_prints(tmp_path):
    """The decision guide's table is the command's output, not numbers written by hand."""
    blocks = marked_blocks()
    for (_, body), (next_mark, expected) in zip(blocks, blocks[1:]):
        if next_mark == "output" and "pipeloom compare" in body:
            assert run_block(body, tmp_path) == expected
            return
    pytest.fail("no compare table under an <!-- output --> mark")


@pytest.mark.slow
def test_the_readme_runs_in_order_on_a_fresh_directory(tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    blocks = marked_blocks()
    for index, (mark, body) in enumerate(blocks):
        if mark == "runnable":
            printed = run_block(body, tmp_path) if index == 0 else run_block_in_process(body, monkeypatch)
            if index + 1 < len(blocks) and blocks[index + 1][0] == "output":
                assert printed == blocks[index + 1][1]
    assert (tmp_path / "plan.json").exists() and (tmp_path / "gpt3-plan.json").exists()


def test_the_readme_python_example_imports_the_public_runtime_only():
    """Its imports are `from pipeloom.runtime import ...`, and every name it imports is there."""
    pytest.importorskip("torch")
    import pipeloom.runtime

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    imports = [line for block in blocks for line in block.splitlines() if line.startswith(("from ", "import "))]
    assert imports and all(line.startswith("from pipeloom.runtime import ") for line in imports), imports
    for line in imports:
        for name in line.removeprefix("from pipeloom.runtime import ").split(","):
            assert name.strip() in pipeloom.runtime.__all__, name
