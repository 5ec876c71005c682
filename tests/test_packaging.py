"""The installed package layout: `models/` and `kernels/` install as `jaxrl.models` and `jaxrl.kernels` (no
top-level `models` or `kernels` module on the user's path), every package directory is listed, py.typed ships."""

import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setuptools() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_directory_is_listed_with_its_directory():
    settings = _setuptools()
    directories = settings["package-dir"]
    listed = {}
    for package in settings["packages"]:
        top = next((p for p in directories if package == p or package.startswith(p + ".")), None)
        base = package.replace(".", os.sep) if top is None else os.path.join(
            directories[top], *package[len(top):].split(".")[1:])
        listed[package] = os.path.normpath(base)
    found = set()
    for top in ("jaxrl", "models", "kernels"):
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            if "__init__.py" in files and "__pycache__" not in directory:
                found.add(os.path.relpath(directory, ROOT))
    assert sorted(found) == sorted(listed.values()), "pyproject.toml [tool.setuptools] packages is out of date"
    assert directories == {"jaxrl.models": "models", "jaxrl.kernels": "kernels"}
    assert "py.typed" in settings["package-data"]["jaxrl"]
    assert os.path.isfile(os.path.join(ROOT, "jaxrl", "py.typed"))


def test_installed_names_live_inside_jaxrl(tmp_path):
    # from a directory without the checkout on sys.path: what a user's project sees after `pip install`
    script = ("import importlib.util as u, jaxrl.models, jaxrl.kernels; "
              "print(u.find_spec('models'), u.find_spec('kernels')); "
              "print(jaxrl.models.__name__, jaxrl.kernels.__name__, jaxrl.models.Policy.__module__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0] == "None None"
    assert lines[1] == "jaxrl.models jaxrl.kernels jaxrl.models.transformer"
