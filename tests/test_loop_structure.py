"""The run package reads top to bottom: short functions, no closures over rebound names, and the path from
the CLI to the jitted step written where a newcomer starts (the package docstring)."""

import ast
import pathlib

import jaxrl.loop

PACKAGE = pathlib.Path(jaxrl.loop.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))
LONGEST = 80  # lines, from `def` to the function's last line, docstring included


def _functions(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_package_has_its_modules():
    assert {p.stem for p in MODULES} >= {"__init__", "experiment", "setup", "generate", "rollout", "held_out",
                                         "warm_start", "rl", "resume", "outputs"}


def test_no_function_in_the_run_package_is_longer_than_80_lines():
    too_long = [f"{path.name}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
                for path in MODULES for fn in _functions(path) if fn.end_lineno - fn.lineno + 1 > LONGEST]
    assert not too_long, too_long


def test_no_function_in_the_run_package_uses_nonlocal_or_closes_over_the_loop():
    """State passes through arguments and return values: no `nonlocal`/`global`, and no function defined
    inside another (whose free names could be rebound by the enclosing loop)."""
    found = [f"{path.name}:{node.lineno}" for path in MODULES
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.Nonlocal, ast.Global))]
    assert not found, found
    nested = [f"{path.name}:{inner.lineno} {inner.name} in {fn.name}"
              for path in MODULES for fn in _functions(path) for inner in ast.walk(fn)
              if inner is not fn and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert not nested, nested


def test_the_package_docstring_names_the_path_from_the_cli_to_the_jitted_step():
    doc = jaxrl.loop.__doc__
    hops = ["cli._train", "experiment.run", "rl.train", "rl.rl_step", "make_rl_step"]
    positions = [doc.find(hop) for hop in hops]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), positions
    from jaxrl.loop import experiment, rl  # and each hop exists
    assert callable(experiment.run) and callable(rl.train) and callable(rl.rl_step)
