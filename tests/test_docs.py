"""The guide's Python blocks run, in order, in one namespace: the docs cannot rot."""
import pathlib
import re

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide.md"


def test_guide_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
