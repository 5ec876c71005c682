"""Checkpoints verified on restore: a byte flipped in the array data never restores as other values, a state
with non-finite arrays is never saved, and retention keeps the newest intact checkpoint."""

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl.checkpoint import Checkpointer, CheckpointDamaged, NonFiniteState, array_digest


def _state(seed=0):
    rng = np.random.default_rng(seed)
    return {"params": {"embed": jnp.asarray(rng.normal(size=(64, 48)), jnp.float32),
                       "norm": jnp.asarray(rng.normal(size=(1200,)), jnp.bfloat16)},  # > 1 KiB: a chunk of its own
            "step": jnp.int32(7)}


def _same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _data_files(step_dir):
    """The files that hold the arrays' bytes (OCDBT data files; zarr metadata is stored inline in them too)."""
    return sorted(os.path.join(root, f) for root, _, files in os.walk(os.path.join(step_dir, "state"))
                  for f in files if os.path.basename(root) == "d")


def _flip(path, position):
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ 0x10]))


def test_a_byte_flipped_in_the_array_data_never_restores_as_other_values(tmp_path):
    """Flips at the first and last bytes and at every eighth between them, in every data file: each one either
    fails the restore (orbax cannot read it, or the digests name the array) or restores the saved values bit
    for bit (a byte that is never read: the per-process tree nodes that orbax merges into one at the end).
    Flips land in the chunks of both float arrays, and each is named."""
    state = _state()
    saved = tmp_path / "saved"
    checkpointer = Checkpointer(saved)
    checkpointer.save(3, state, {"rl_step": 3})
    checkpointer.close()
    files = _data_files(saved / "3")
    assert files
    named, outcomes = set(), []
    for i, path in enumerate(files):
        size = os.path.getsize(path)
        for position in sorted({*range(0, size, max(1, size // 8)), size - 1}):
            work = tmp_path / f"work_{i}_{position}"
            shutil.copytree(saved, work)
            _flip(str(path).replace(str(saved), str(work)), position)
            try:
                restored, _ = Checkpointer(work).restore(3, state)
            except CheckpointDamaged as e:
                named |= {name for name in ("params.embed", "params.norm", "step") if name in str(e)}
                outcomes.append("digest")
                continue
            except Exception:  # noqa: BLE001  orbax / tensorstore could not read it: damaged as well
                outcomes.append("unreadable")
                continue
            assert _same(restored, state), f"a flip at byte {position} of {path} restored other values unnoticed"
            outcomes.append("unchanged")
    assert {"params.embed", "params.norm"} <= named, (named, outcomes, [os.path.getsize(p) for p in files])


def test_the_digest_sees_every_single_element_change_and_matches_a_numpy_reference():
    """Independent reference: the digest recomputed in numpy from the bytes. Every single-bit change of one
    element, and a swap of two elements, changes both lanes."""
    def fmix32(h):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))

    def reference(x: np.ndarray) -> np.ndarray:
        words = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint32).ravel()
        position = np.arange(words.size, dtype=np.uint32)
        with np.errstate(over="ignore"):
            return np.array([fmix32((words * np.uint32(a)) ^ fmix32(position + np.uint32(s))).sum(dtype=np.uint32)
                             for a, s in ((1, 0x9E3779B9), (0x2545F491, 0x7F4A7C15))], np.uint32)

    rng = np.random.default_rng(1)
    for x in (rng.normal(size=(5, 7)).astype(np.float32), rng.normal(size=(11,)).astype(ml_dtypes.bfloat16),
              rng.integers(-9, 9, (3, 4)).astype(np.int32), rng.random(6) > 0.5):
        np.testing.assert_array_equal(np.asarray(array_digest(jnp.asarray(x))), reference(x))

    x = rng.normal(size=(4, 8)).astype(np.float32)
    base = np.asarray(array_digest(jnp.asarray(x)))
    bits = x.view(np.uint32)
    for bit in range(32):
        changed = bits.copy()
        changed[2, 5] ^= np.uint32(1 << bit)
        assert (np.asarray(array_digest(jnp.asarray(changed.view(np.float32)))) != base).all(), bit
    swapped = x.copy()
    swapped[0, 0], swapped[3, 7] = x[3, 7], x[0, 0]
    assert (np.asarray(array_digest(jnp.asarray(swapped))) != base).all()


def test_damaged_metadata_or_digests_are_named(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, _state(), {"rl_step": 1, "prompt_iterator": {"position": 12}})
    checkpointer.save(2, _state(), {"rl_step": 2, "prompt_iterator": {"position": 24}})
    checkpointer.wait()
    metadata = tmp_path / "1" / "metadata" / "metadata"
    metadata.write_text(metadata.read_text().replace("12", "13"))  # parses, but another data position
    with pytest.raises(CheckpointDamaged, match=r"^checkpoint 1: its metadata does not match its digest$"):
        checkpointer.restore(1, _state())
    digests = tmp_path / "2" / "digests" / "metadata"
    digests.write_text(digests.read_text()[:-3])
    with pytest.raises(CheckpointDamaged, match=r"^checkpoint 2: its digests do not read \(JSONDecodeError"):
        checkpointer.restore(2, _state())
    checkpointer.close()


def test_a_state_with_non_finite_arrays_is_never_saved(tmp_path):
    state = _state()
    state["params"]["norm"] = state["params"]["norm"].at[4].set(jnp.inf)
    checkpointer = Checkpointer(tmp_path)
    with pytest.raises(NonFiniteState, match=r"^checkpoint 5 not saved: non-finite values in params.norm$"):
        checkpointer.save(5, state, {})
    checkpointer.close()
    assert Checkpointer.newest(tmp_path) is None


def test_retention_keeps_the_newest_intact_checkpoint_past_damaged_newer_ones(tmp_path):
    """keep=2 with checkpoints 2 (intact) and 3 (a flipped byte): once 3 fails its digests, saving 4 keeps 2
    (orbax's newest-2 alone would delete it and keep the damaged 3), and the damaged 3 is never deleted."""
    first = Checkpointer(tmp_path, keep=2)
    first.save(2, _state(2), {})
    first.save(3, _state(3), {})
    first.close()
    error = None
    for path in _data_files(tmp_path / "3"):  # damage an array value: the flip the digests see
        for position in range(os.path.getsize(path) // 4, os.path.getsize(path), 97):
            shutil.copy(path, path + ".bak")
            _flip(path, position)
            try:
                Checkpointer(tmp_path, keep=2).restore(3, _state())
            except CheckpointDamaged as e:
                error = str(e)
                break
            except Exception:  # noqa: BLE001  unreadable: try another byte
                pass
            shutil.move(path + ".bak", path)
        if error:
            os.remove(path + ".bak")
            break
    assert error and "does not match" in error

    checkpointer = Checkpointer(tmp_path, keep=2)
    with pytest.raises(CheckpointDamaged, match=r"^checkpoint 3: array "):
        checkpointer.restore(3, _state())
    restored, _ = checkpointer.restore(2, _state())
    assert _same(restored, _state(2))
    checkpointer.save(4, _state(4), {})
    checkpointer.wait()
    assert checkpointer.steps() == [2, 3, 4]
    checkpointer.save(5, _state(5), {})
    checkpointer.wait()
    assert checkpointer.steps() == [3, 4, 5]  # two intact ones newer than 2; the damaged 3 stays for inspection
    checkpointer.close()


def test_a_checkpoint_without_digests_restores_unverified_with_a_warning(tmp_path, caplog):
    """Checkpoints written before digests existed (state and metadata only) still resume."""
    manager = ocp.CheckpointManager(os.path.abspath(tmp_path), options=ocp.CheckpointManagerOptions(create=True))
    manager.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(_state()),
                                            metadata=ocp.args.JsonSave({"rl_step": 4})))
    manager.wait_until_finished()
    manager.close()
    with caplog.at_level(logging.WARNING, logger="jaxrl.checkpoint"):
        restored, metadata = Checkpointer(tmp_path).restore(None, _state())
    assert metadata == {"rl_step": 4} and _same(restored, _state())
    assert "checkpoint 4" in caplog.text and "no array digests" in caplog.text
