"""The one exception base of jaxrl: every error the library raises for bad input or a stopped run is a
`JaxrlError`, so `jaxrl.cli` catches them in one place and prints `jaxrl: <kind>: <message>`.

Each subclass keeps its older bases (`ValueError` mostly), so `except ValueError` in user code still works.
"""

from __future__ import annotations


class JaxrlError(Exception):
    """Base of every jaxrl error. `kind`: the label the CLI prints before the message ("" prints the message
    alone); `exit_code`: the CLI's exit status (2: bad input)."""

    kind: str = "error"
    exit_code: int = 2


class RunConfigError(JaxrlError, ValueError):
    """The run's config contradicts itself, the devices or the output directory (mesh and batch sizes,
    rl.overlap with several processes, an output_dir that holds another run, ...)."""

    kind = "error"


class TrainingDiverged(JaxrlError, RuntimeError):
    """Too many consecutive RL steps had a non-finite loss or gradient (`rl.max_consecutive_skips`)."""

    kind = "training stopped"
    exit_code = 3


class Preempted(JaxrlError, RuntimeError):
    """The run received SIGTERM (e.g. a TPU preemption notice) and saved a checkpoint after its current step."""

    kind = ""  # the message says it all
    exit_code = 143  # 128 + SIGTERM, as if the signal had ended the process
