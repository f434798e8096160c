"""The README's Python examples: the core API example runs exactly as written, and the Flower snippet is what the
shipped example app does."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def api_examples():
    return [b for b in python_blocks() if "fedcomp.build(" in b]


def test_readme_has_one_api_example():
    assert len(api_examples()) == 1


def test_readme_flower_snippet_is_the_example_app():
    """The README's two lines (and their imports) are what the shipped example app does."""
    (snippet,) = [b for b in python_blocks() if "compression_mod" in b]
    app = ROOT / "examples" / "compressed-digits" / "digits_app"
    client, server = (app / "client_app.py").read_text(), (app / "server_app.py").read_text()
    for line, source in [
        ("from fedcomp.flower import compression_mod", client),
        ("app = ClientApp(mods=[compression_mod])", client),
        ("from fedcomp.flower import Compressed", server),
    ]:
        assert line in snippet and line in source, line
    assert "strategy = Compressed(FedAvg(...))" in snippet
    assert 'Compressed(fedavg, run_config["compressor"], density=run_config["density"]' in server


def test_readme_api_example_runs(capsys):
    exec(compile(api_examples()[0], str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    sent, dense = map(int, re.match(r"(\d+) bytes instead of (\d+) dense", out).groups())
    assert 0 < sent < dense
