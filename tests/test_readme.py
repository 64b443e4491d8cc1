"""README's Quick start commands are exactly what CI runs (.ci/run), in order."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    cmds = []
    for line in block.splitlines():
        cmds += [c.strip() for c in line.split("&&") if c.strip()]
    return cmds


def test_ci_runs_the_readme_commands_verbatim():
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
          if l.strip() and not l.strip().startswith("#")]
    cmds = quick_start_commands()
    assert cmds[0] == "python3 -m venv .venv" and cmds[1] == ". .venv/bin/activate"
    positions = [ci.index(c) for c in cmds[2:]]  # ValueError if one is missing
    assert positions == sorted(positions), "CI must run the README commands in order"
    assert any("python3 -m venv .venv" in l for l in ci) and ". .venv/bin/activate" in ci


def test_the_simulator_modules_exist():
    # conftest marks these slow on a machine without a GPU: a renamed module would silently
    # move minutes of simulator tests into the quick suite
    from conftest import SIMULATOR_MODULES
    missing = sorted(m for m in SIMULATOR_MODULES if not (ROOT / "tests" / m).is_file())
    assert not missing, f"conftest.SIMULATOR_MODULES names missing files: {missing}"


def test_ci_runs_the_readme_slow_test_command():
    text = (ROOT / "README.md").read_text().split("### Tests", 1)[1]
    slow = re.search(r"^(python -m pytest -q -m slow[^#\n]*?)\s*(#.*)?$", text, re.M).group(1).strip()
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert slow in ci, f"README's slow-test command {slow!r} is not what .ci/run runs"
