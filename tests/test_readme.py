"""The README's Python example is the documented API: run it exactly as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_one_api_example():
    assert len(python_blocks()) == 1


def test_readme_api_example_runs(capsys):
    exec(compile(python_blocks()[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    sent, dense = map(int, re.match(r"(\d+) bytes instead of (\d+) dense", out).groups())
    assert 0 < sent < dense
