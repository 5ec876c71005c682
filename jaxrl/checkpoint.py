"""Orbax checkpoints of the run state: arrays (params, optimizer state, step) plus JSON metadata
(data-iterator state, RNG seed, phase)."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves `{state pytree, metadata dict}` under `directory/<step>`, keeping the newest `keep`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self._manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def save(self, step: int, state: Any, metadata: dict) -> None:
        """Asynchronous save; call `wait()` (or `close()`) before reading the files."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata)))

    @property
    def directory(self) -> str:
        return str(self._manager.directory)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        return sorted(self._manager.all_steps())

    @staticmethod
    def newest(directory: str | os.PathLike) -> int | None:
        """The newest complete checkpoint step under `directory` (None: no directory or no checkpoint); reads
        without creating anything."""
        if not os.path.isdir(directory):
            return None
        steps = ocp.utils.checkpoint_steps(os.path.abspath(directory))
        return max(steps) if steps else None

    def restore(self, step: int | None, like: Any) -> tuple[Any, dict]:
        """Restore the state with the structure, shapes, dtypes and shardings of `like`."""
        step = self._manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        _check_shapes(self._manager.directory / str(step) / "state", abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()))
        return restored["state"], restored["metadata"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _check_shapes(state_dir, like: Any) -> None:
    """Raise a `ValueError` naming the arrays of `like` whose shapes differ from those saved in `state_dir`
    (orbax's own error names no array, and suggests truncating it)."""
    try:
        saved = ocp.tree.to_flat_dict(ocp.StandardCheckpointHandler().metadata(state_dir))
    except FileNotFoundError:
        return  # no metadata: the restore itself says what is missing
    wrong = [f"{'.'.join(map(str, path))} is {tuple(saved[path].shape)} in the checkpoint, {tuple(x.shape)} here"
             for path, x in ocp.tree.to_flat_dict(like).items()
             if getattr(saved.get(path), "shape", None) is not None and tuple(saved[path].shape) != tuple(x.shape)]
    if wrong:
        more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ValueError(f"checkpoint {state_dir.parent.name} does not fit: " + "; ".join(wrong[:3]) + more)
