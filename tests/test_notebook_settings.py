"""Every notebook's SIZES ("small" and "large") must be valid overrides of configs/default.yaml.

CI executes the notebooks only with their small settings (`make notebooks`), so a typo in the "large" ones
(meant for an accelerator) would otherwise surface only on the machine it was meant for.
"""

import ast
import glob
import json
import os

import pytest

from jaxrl.config import Config
from jaxrl.configlib import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))


def _sizes(path: str) -> dict[str, list[str]]:
    """The literal ``SIZES = {...}`` assigned in the notebook's code cells ({} if none)."""
    with open(path, encoding="utf-8") as f:
        cells = json.load(f)["cells"]
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for node in ast.parse("".join(cell["source"])).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["SIZES"]:
                return ast.literal_eval(node.value)
    return {}


WITH_SIZES = [p for p in NOTEBOOKS if _sizes(p)]


def test_the_notebooks_with_settings_are_found():
    assert len(WITH_SIZES) >= 4, [os.path.basename(p) for p in WITH_SIZES]


@pytest.mark.parametrize("path", WITH_SIZES, ids=os.path.basename)
def test_notebook_sizes_are_valid_overrides(path):
    sizes = _sizes(path)
    assert set(sizes) == {"small", "large"}
    recipe = os.path.join(REPO, "configs", "default.yaml")
    loaded = {name: load_config(Config, recipe, overrides) for name, overrides in sizes.items()}  # raises if bad
    # "large" runs the recipe's own warm start: only "small" shortens it.
    assert loaded["large"].sft.steps == load_config(Config, recipe, []).sft.steps
