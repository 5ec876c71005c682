"""One exception base: every jaxrl error is a `JaxrlError` (keeping its older base), and the CLI turns each
into one line `jaxrl: <kind>: <message>` and its exit code, in one handler."""

import ast
import pathlib

import pytest

from jaxrl import cli, configlib, loop
from jaxrl.data.prompts import DataError
from jaxrl.errors import JaxrlError, Preempted, RunConfigError, TrainingDiverged
from jaxrl.models.hf import CheckpointError
from jaxrl.models.hf_config import ConfigError as HFConfigError
from jaxrl.plan.topology import PlanError
from jaxrl.tokenizer import ChatTemplateError, TokenizerError

ERRORS = {configlib.ConfigError: "configuration error", DataError: "data error", CheckpointError: "checkpoint error",
          HFConfigError: "checkpoint error", TokenizerError: "tokenizer error", ChatTemplateError: "tokenizer error",
          PlanError: "plan error", RunConfigError: "error"}


@pytest.mark.parametrize("error, kind", ERRORS.items(), ids=[e.__name__ for e in ERRORS])
def test_every_input_error_is_a_jaxrl_error_and_still_a_value_error(error, kind):
    assert issubclass(error, JaxrlError) and issubclass(error, ValueError)
    assert (error.kind, error.exit_code) == (kind, 2)


@pytest.mark.parametrize("error, code, line", [
    (DataError("data.train_file: x.jsonl:3: no field 'question'"), 2,
     "jaxrl: data error: data.train_file: x.jsonl:3: no field 'question'"),
    (RunConfigError("eval.batch_size = 3 rows do not split"), 2, "jaxrl: error: eval.batch_size = 3 rows do not split"),
    (TrainingDiverged("RL steps 2..3: 2 consecutive steps"), 3,
     "jaxrl: training stopped: RL steps 2..3: 2 consecutive steps"),
    (Preempted("stopped by SIGTERM after RL step 4"), 143, "jaxrl: stopped by SIGTERM after RL step 4"),
    (OSError("No space left on device"), 2, "jaxrl: error: No space left on device"),
])
def test_the_cli_prints_one_line_and_the_exit_code_of_each_error(monkeypatch, capsys, error, code, line):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(loop, "run", fail)
    assert cli.main(["train", "configs/default.yaml"]) == code
    assert capsys.readouterr().err.strip() == line


def test_eval_errors_after_the_config_loads_read_eval_error(monkeypatch, capsys):
    monkeypatch.setattr(loop, "evaluate_checkpoint", lambda *a, **k: (_ for _ in ()).throw(CheckpointError("gone")))
    assert cli.main(["eval", "configs/default.yaml", "checkpoint=somewhere"]) == 2
    assert capsys.readouterr().err.strip() == "jaxrl: eval error: gone"
    assert cli.main(["eval", "configs/default.yaml", "checkpoint=somewhere", "rl.steps=many"]) == 2
    assert capsys.readouterr().err.startswith("jaxrl: configuration error: ")


def test_cli_has_one_handler_for_jaxrl_errors():
    tree = ast.parse(pathlib.Path(cli.__file__).read_text())
    handlers = [h for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)]
    named = [ast.unparse(h.type) for h in handlers if h.type is not None]
    assert named.count("JaxrlError") == 1, named
    jaxrl_errors = {"ConfigError", "DataError", "CheckpointError", "TokenizerError", "ChatTemplateError",
                    "Preempted", "TrainingDiverged", "HFConfigError"}
    assert not [n for n in named if any(e in n for e in jaxrl_errors)], named
