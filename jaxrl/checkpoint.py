"""Orbax checkpoints of the run state: arrays (params, optimizer state, step) plus JSON metadata
(data-iterator state, RNG seed, phase), and a digest of every array, verified when it is restored.

Layout of `directory/<step>/`: `state/` (orbax's arrays), `metadata/` (JSON) and `digests/` (JSON: per array
its dtype, shape and `array_digest`, and the sha256 of the metadata's JSON). The three are items of one orbax
save, so the step directory is committed (renamed into place, `commit_success.txt`) only once all of them are
written: a crash never leaves digests beside arrays of another save.

Why our own digests: orbax 0.12 writes zarr v2 chunks (zstd) into OCDBT files without any checksum of the
data (its zarr3 layout checksums only the shard index), and a byte flipped in a data file restores silently
as other values (issue 31; `tests/test_checkpoint.py`).

The digest (`array_digest`) is computed on the device from the global array, so it needs no copy to the
host, and every process of a multi-host job gets the same value. It is a sum modulo 2**32 of a bijective
mix (murmur3's finaliser) of each element's bits with its position, in two lanes with different seeds:
integer sums are exact and associative, so the value does not depend on the mesh or on how the reduction
is split, and a checkpoint written from a (2,2,2) mesh verifies on (1,1,8). A change of one 32-bit word
(one element of 32 bits or fewer) always changes both lanes, since the mix is a bijection of the word's
bits; other changes go unseen with probability about 2**-64. It guards against accidental damage (disks,
copies, truncation), not against someone who can rewrite the checkpoint: they can rewrite its digests too.

Retention (`keep`): the newest `keep` checkpoints not known to be damaged, and always the newest intact one.
A checkpoint is intact when this `Checkpointer` restored it and its digests matched, or wrote it (its
digests are of the very arrays handed to orbax, and orbax commits a step only once its files are all
written). Written checkpoints are not read back: that would cost a full read of the state at every save
(for a 7B model with Adam, about 84 GB). Damage after the write is found when the checkpoint is restored,
and the fallback is then the newest older checkpoint that verifies.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.sharding import process_max
from jaxrl.models.safe_read import read_json_file

log = logging.getLogger(__name__)

DIGEST_FORMAT = "jaxrl array digest v1: two uint32 sums of fmix32(element bits ^ mix(position))"


class CheckpointDamaged(ValueError):
    """A checkpoint's arrays do not match the digests saved with them (or its digests do not parse)."""


class NonFiniteState(ValueError):
    """A state with NaN or infinite floating-point arrays was given to `Checkpointer.save`."""


class Checkpointer:
    """Saves `{state pytree, metadata dict}` under `directory/<step>` with a digest of every array; keeps the
    newest `keep` (and the newest intact one, see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2, intact: Sequence[int] = ()):
        """`intact`: steps known to be intact (verified by an earlier `Checkpointer` of this process)."""
        self._intact: set[int] = set(intact)  # restored and verified here, or written here
        self._damaged: set[int] = set()  # failed verification here
        self._manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
                create=True, preservation_policy=_KeepNewestIntact(keep, self._retention_view)))

    def _retention_view(self) -> tuple[set[int], set[int]]:
        return set(self._intact), set(self._damaged)

    def save(self, step: int, state: Any, metadata: dict) -> None:
        """Asynchronous save; call `wait()` (or `close()`) before reading the files.

        Raises `NonFiniteState`, naming the arrays, before anything is written when a floating-point array of
        `state` holds a NaN or an infinity: such a state is never saved as a checkpoint to resume from.
        """
        digests, finite = _digests_and_finite(state)
        bad = [path for path, ok in finite.items() if not ok]
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise NonFiniteState(f"checkpoint {step} not saved: non-finite values in {', '.join(bad[:3])}{more}")
        self._intact.add(step)
        self._damaged.discard(step)
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(metadata),
            digests=ocp.args.JsonSave({"format": DIGEST_FORMAT, "arrays": digests,
                                       "metadata_sha256": _json_digest(metadata)})))

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
        """Restore the state with the structure, shapes, dtypes and shardings of `like`, verified against its
        digests. Raises `CheckpointDamaged` naming the step and the arrays that differ (the step is then
        known to be damaged and kept out of `keep`'s count); a checkpoint written before digests existed is
        restored unverified, with a warning."""
        step = self._manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self._manager.directory}")
        step_dir = self._manager.directory / str(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        _check_shapes(step_dir / "state", abstract)
        if not (step_dir / "digests").is_dir():
            log.warning("checkpoint %d in %s has no array digests (saved before they were written): restored "
                        "unverified", step, self._manager.directory)
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()))
            return restored["state"], restored["metadata"]
        error, saved = None, {}
        try:  # a damaged digests file: the checkpoint cannot be trusted
            record = self._manager.restore(step, args=ocp.args.Composite(digests=ocp.args.JsonRestore()))["digests"]
            saved = _parse_digests(record)
        except Exception as e:
            error = CheckpointDamaged(f"checkpoint {step}: its digests do not read ({type(e).__name__}: {e})")
        self._agree(step, error)
        # Restored with the saved dtypes, verified, then cast to `like`'s: a cast is not always reversible.
        flat = ocp.tree.to_flat_dict(abstract)
        missing = [_name(path) for path in flat if _name(path) not in saved]
        if missing:  # the same on every process: they read the same file
            self._damaged.add(step)
            raise CheckpointDamaged(f"checkpoint {step}: no digest for {', '.join(missing[:3])}")
        as_saved = ocp.tree.from_flat_dict(
            {path: jax.ShapeDtypeStruct(x.shape, saved[_name(path)][0], sharding=x.sharding)
             for path, x in flat.items()}, target=abstract)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(as_saved), metadata=ocp.args.JsonRestore()))
        except Exception as e:  # orbax and tensorstore raise many types for missing or damaged files
            error = e
        self._agree(step, error)
        state = restored["state"]
        found, _ = _digests_and_finite(state)
        wrong = [f"{name} (saved {saved[name][1]}, read {found[name]['digest']})"
                 for name in found if found[name]["digest"] != saved[name][1]]
        if wrong:
            self._damaged.add(step)
            more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
            one = len(wrong) == 1
            raise CheckpointDamaged(f"checkpoint {step}: {'array' if one else 'arrays'} {', '.join(wrong[:3])}{more} "
                                    f"{'does not match its digest' if one else 'do not match their digests'}")
        if record.get("metadata_sha256") != _json_digest(restored["metadata"]):
            self._damaged.add(step)
            raise CheckpointDamaged(f"checkpoint {step}: its metadata does not match its digest")
        self._intact.add(step)
        self._damaged.discard(step)
        state = jax.tree.map(lambda x, target: x if x.dtype == target.dtype else x.astype(target.dtype),
                             state, abstract)
        return state, restored["metadata"]

    def _agree(self, step: int, error: Exception | None) -> None:
        """Raise `error` (or, where this process had none, `CheckpointDamaged`) when reading `step` failed on
        any process: each reads its own shards, and all must take the same checkpoint before the digests (a
        collective) are computed. The step is then known to be damaged."""
        failed = error is not None
        if jax.process_count() > 1:
            failed = bool(process_max(int(failed)))
        if failed:
            self._damaged.add(step)
            raise error or CheckpointDamaged(f"checkpoint {step}: another process could not read it")

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


@dataclasses.dataclass
class _KeepNewestIntact:
    """An orbax preservation policy: the newest `keep` checkpoints not known to be damaged, the newest intact
    one whatever its age, and every damaged one (evidence, set aside by the caller, never deleted here)."""

    keep: int
    view: Callable[[], tuple[set[int], set[int]]]  # () -> (intact steps, damaged steps)

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        intact, damaged = self.view()
        steps = [c.step for c in checkpoints]
        usable = sorted(s for s in steps if s not in damaged)
        kept = set(usable[-self.keep:]) | damaged
        newest_intact = max((s for s in usable if s in intact), default=None)
        if newest_intact is not None:
            kept.add(newest_intact)
        return [s in kept for s in steps]


def verify_saved_arrays(step_dir: str | os.PathLike, tree: Any) -> None:
    """Check the arrays of `tree`, a part of the state restored from the checkpoint `step_dir` (e.g.
    `{"params": params}`, read in their saved dtypes), against the digests saved with it. For readers other
    than `Checkpointer.restore` (`jaxrl eval`, `pretrained.path=<run>`). Raises `CheckpointDamaged` naming the
    step directory and the arrays; a checkpoint saved before digests existed passes with a warning."""
    digests_file = os.path.join(step_dir, "digests", "metadata")
    if not os.path.isdir(os.path.join(step_dir, "digests")):
        log.warning("checkpoint %s has no array digests (saved before they were written): read unverified", step_dir)
        return
    try:
        saved = _parse_digests(read_json_file(digests_file, error=ValueError))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamaged(f"checkpoint {step_dir}: its digests do not read ({type(e).__name__}: {e})") from None
    found, _ = _digests_and_finite(tree)
    wrong = [name for name in found if name not in saved or saved[name][1] != found[name]["digest"]]
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise CheckpointDamaged(f"checkpoint {step_dir}: {', '.join(wrong[:3])}{more} "
                                "do not match the digests saved with it")


def _name(path: tuple) -> str:
    return ".".join(map(str, path))


def _parse_digests(record: Any) -> dict[str, tuple[np.dtype, str]]:
    """`{array name: (saved dtype, digest hex)}` of a `digests` item."""
    if not isinstance(record, dict) or record.get("format") != DIGEST_FORMAT:
        raise ValueError(f"not a digest record of format {DIGEST_FORMAT!r}")
    return {name: (np.dtype(entry["dtype"]), str(entry["digest"])) for name, entry in record["arrays"].items()}


def _json_digest(value: Any) -> str:
    """sha256 of `value`'s canonical JSON (as read back: tuples as lists, keys as strings; sorted keys), the
    same for the metadata as saved and as restored."""
    return hashlib.sha256(json.dumps(json.loads(json.dumps(value)), sort_keys=True).encode()).hexdigest()


def _fmix32(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 that spreads every input bit over the output."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32, one per element (`[*shape]`), or two for 64-bit dtypes (`[*shape, 2]`)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size in (1, 2, 4):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]).astype(jnp.uint32)
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    raise TypeError(f"no digest for dtype {x.dtype}")


def array_digest(x: jax.Array) -> jax.Array:
    """`[2]` uint32 digest of the global array `x` (any sharding; see the module docstring): lane k is
    `sum_i fmix32(bits_i * a_k ^ fmix32(i + s_k)) mod 2**32`, `i` the row-major position of each 32-bit word."""
    words = _words(x)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):  # row-major position built from iotas: keeps `x`'s sharding
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    lanes = []
    for a, s in ((1, 0x9E3779B9), (0x2545F491, 0x7F4A7C15)):  # odd multipliers: bijections of the bits
        lanes.append(jnp.sum(_fmix32((words * jnp.uint32(a)) ^ _fmix32(position + jnp.uint32(s))),
                             dtype=jnp.uint32))
    return jnp.stack(lanes)


def _check(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`([2] uint32 digest, bool all finite)` of one array."""
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return array_digest(x), finite


@functools.lru_cache(maxsize=16)
def _checker(out: jax.sharding.Sharding) -> Callable:
    """`_check` jitted with its results replicated by `out`; one program per shape and dtype (a state has
    few: parameters and their Adam moments share theirs), each compiled once."""
    return jax.jit(_check, out_shardings=(out, out))


def _replicated(x: jax.Array) -> jax.sharding.Sharding:
    """A sharding replicating a small result over the devices of `x`."""
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("all",)), jax.sharding.PartitionSpec())


def _digests_and_finite(tree: Any) -> tuple[dict[str, dict], dict[str, bool]]:
    """`({name: {"dtype", "shape", "digest"}}, {name: all finite})` of every array of `tree`, computed on the
    arrays' devices (collectives over every process of a multi-host job: all must call this alike)."""
    flat = ocp.tree.to_flat_dict(tree)
    names = [_name(path) for path in flat]
    leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in flat.values()]
    results = []
    for x in leaves:
        results.append(_checker(_replicated(x))(x))
        # One collective program in flight at a time: several deadlock gloo across processes, and starve XLA's
        # CPU rendezvous within one (8 host devices on 2 cores: "only 5 of 8 arrived" within its 40 s).
        if jax.process_count() > 1 or len(x.sharding.device_set) > 1:
            jax.block_until_ready(results[-1])
    # replicated: every process holds the whole result; one transfer of them all
    digests, finite = jax.device_get(([d.addressable_data(0) for d, _ in results],
                                      [f.addressable_data(0) for _, f in results]))
    finite = [bool(f) for f in finite]
    record = {name: {"dtype": str(x.dtype), "shape": list(x.shape), "digest": d.astype(">u4").tobytes().hex()}
              for name, x, d in zip(names, leaves, digests)}
    return record, dict(zip(names, finite))


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
