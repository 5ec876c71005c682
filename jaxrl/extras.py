"""Optional extras a config turns on, checked before a run touches its output directory.

`check_extras(config)` raises `MissingExtra` naming the config key and the install command that fits how
jaxrl is installed: from a source checkout (an editable install) `pip install -e '.[wandb]'` run in that
checkout, otherwise `pip install 'jaxrl[wandb]'`.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import jaxrl
from jaxrl.errors import JaxrlError

__all__ = ["MissingExtra", "check_extras", "install_command", "source_checkout"]


class MissingExtra(JaxrlError, ImportError):
    """A config key turns on an optional extra whose package is not installed."""

    kind = "missing extra"


def source_checkout() -> str | None:
    """The repository jaxrl is imported from when it is a source checkout (its pyproject.toml beside the
    `jaxrl` package), else None (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxrl.__file__)))
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            is_jaxrl = 'name = "jaxrl"' in f.read()
    except OSError:
        return None
    return root if is_jaxrl else None


def install_command(extra: str) -> str:
    """The command that installs `extra`: `cd <checkout> && pip install -e '.[extra]'` in a source checkout,
    else `pip install 'jaxrl[extra]'`."""
    root = source_checkout()
    if root is not None:
        return f"cd {root} && pip install -e '.[{extra}]'"
    return f"pip install 'jaxrl[{extra}]'"


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: blocked (as a test fakes a missing package)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_extras(config) -> None:
    """Raise `MissingExtra` for the first config key that is on (`tensorboard: true`, `wandb: true`: the
    registered writers' `extra` and `package`) whose package is missing, with the command that installs it.
    Imports none of those packages."""
    from jaxrl import registry
    from jaxrl.metrics import enabled_writers

    for key, name in enabled_writers(config):
        info = registry.resolve("writer", name, key).info
        extra, module = info.get("extra"), info.get("package")
        if module is not None and not _installed(module):
            raise MissingExtra(f"{key}: true needs the {module} package, which is not installed: "
                               f"{install_command(extra)} (or set {key}: false)")
