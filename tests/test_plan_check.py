"""benchmarks/plan_check.py: its measuring part on CPU (the smoke path of `--chip`), and the comparison table.

The whole script (a process per phase, then `jaxrl plan`) takes about a minute on the 2-core machine; here the
phases run in this process, without the plan: each phase's predicted peak is then the plan's estimate of
that phase's own compile (`jaxrl.plan.estimate.estimate`, what `make_plan` computes for it).
"""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["plan.prompt_len=8", "rl.prompts_per_step=2", "rl.group_size=2", "rl.sampling.max_new_tokens=4",
        "eval.batch_size=2"]


def _plan_check():
    """`benchmarks/plan_check.py` as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("plan_check", ROOT / "benchmarks" / "plan_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_measures_every_phase_of_the_default_recipe_beside_a_predicted_peak():
    pc = _plan_check()
    config = pc.load(str(ROOT / "configs" / "default.yaml"), TINY)
    measured = {phase: pc.measure_phase(config, phase, steps=1, chip="H100") for phase in pc.phases_of(config)}
    rows = json.loads(json.dumps(pc.compare(measured, None, gpu=False)))
    assert [r["phase"] for r in rows] == ["sample", "logprobs", "train_step"]
    for row, m in zip(rows, measured.values()):
        assert "error" not in row
        assert m["times_s"] and all(t > 0 for t in m["times_s"]) and row["median_s"] == m["median_s"]
        assert row["step_s"] == pytest.approx(row["median_s"] * row["calls_per_step"])
        assert row["predicted_peak_bytes"] > 0 and row["predicted_from"] == "the phase's own compile"
        assert row["peak_bytes"] > 0 and "not comparable" in row["peak_source"]
        assert row["flag"] is None  # a CPU run is never flagged
        assert m["chip"] == "H100" and m["platform"] == "cpu"
    by_phase = dict(zip(measured, rows))
    # the sampler keeps the optimizer state (Adam's two float32 moments) beside it; the train step's arguments are
    # the whole state, so its prediction covers the policy (half the optimizer state) and the optimizer state
    optimizer = measured["sample"]["predicted"]["resident_elsewhere_bytes"]
    assert optimizer > 0 and by_phase["train_step"]["predicted_peak_bytes"] >= optimizer * 3 // 2
    assert by_phase["sample"]["roofline_s"] is None  # the whole sampler's roofline needs the plan's prefill + decode
    # random inputs as documented: a finite loss, so the update was applied; tokens sampled within the budget
    assert measured["train_step"]["skipped"] == [0.0]
    assert 0 < measured["sample"]["generated_tokens"] <= measured["sample"]["full_tokens"] == 2 * 2 * 4
    text = pc.table(rows, gpu=False)
    assert all(phase in text for phase in measured) and "peak RSS GiB" in text


def _measured(peak: int, predicted: int, median: float = 2.0, calls_per_step: float = 1) -> dict:
    return {"calls_per_step": calls_per_step, "calls": 3, "median_s": median, "step_s": median * calls_per_step,
            "peak_bytes": peak, "peak_source": "device peak_bytes_in_use", "peak_after_compile_bytes": 1,
            "peak_after_inputs_bytes": 2, "predicted": {"peak_bytes": predicted, "time_s": None}}


def test_compare_takes_the_plans_figures_and_flags_a_peak_more_than_20_percent_off():
    pc = _plan_check()
    plan = {"programs": [
        {"name": "sample", "peak_bytes": 100, "time_s": 9.0},  # the whole sampler: not its roofline
        {"name": "prefill", "peak_bytes": 50, "time_s": 0.25},
        {"name": "decode_step", "peak_bytes": 60, "time_s": 0.75},
        {"name": "train_step", "peak_bytes": 1000, "time_s": 0.5}]}
    measured = {"sample": _measured(119, 7), "logprobs": _measured(50, 100),
                "train_step": _measured(1300, 10, median=1.0, calls_per_step=2), "values": {"error": "timed out"}}
    rows = {r["phase"]: r for r in pc.compare(measured, plan, gpu=True)}
    sample, logprobs, train = rows["sample"], rows["logprobs"], rows["train_step"]
    assert sample["roofline_s"] == 1.0 and sample["measured_over_roofline"] == 2.0
    assert sample["predicted_peak_bytes"] == 100 and sample["predicted_from"] == "plan"
    assert sample["peak_ratio"] == pytest.approx(1.19) and sample["flag"] is None
    # no plan row for logprobs: its own compile's prediction, half of it measured: flagged
    assert logprobs["predicted_from"] == "the phase's own compile"
    assert logprobs["flag"] == "peak -50% off the prediction"
    assert train["roofline_step_s"] == 1.0 and train["step_s"] == 2.0
    assert train["flag"] == "peak +30% off the prediction"
    assert train["peak_set_by"] == "the calls"
    assert rows["values"] == {"phase": "values", "error": "timed out"}
    assert not [r for r in pc.compare(measured, plan, gpu=False) if r.get("flag")]  # CPU: never flagged
    text = pc.table(list(rows.values()), gpu=True)
    assert "+30% off" in text and "error: timed out" in text


def test_random_like_gives_valid_inputs_with_the_abstract_sharding():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    pc = _plan_check()
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    placed = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    tree = {"weight": jax.ShapeDtypeStruct((64, 8), jnp.bfloat16, sharding=placed),
            "nu": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=placed),
            "tokens": jax.ShapeDtypeStruct((4, 100), jnp.int32, sharding=placed),
            "valid": jax.ShapeDtypeStruct((4, 100), jnp.bool_, sharding=placed),
            "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
            "temperature": jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),
            "rng": jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)}
    out = pc.random_like(tree, vocab_size=7)
    for name, leaf in tree.items():
        assert out[name].shape == leaf.shape and out[name].dtype == leaf.dtype and out[name].sharding == leaf.sharding
    for name in ("weight", "nu"):
        values = jnp.asarray(out[name], jnp.float32)
        assert float(values.min()) > 0 and float(values.max()) < 0.021 and float(values.std()) > 0
    assert 0 <= int(out["tokens"].min()) and int(out["tokens"].max()) < 7 and len(set(out["tokens"].ravel().tolist())) > 1
    assert bool(out["valid"].all()) and int(out["count"]) == 0 and float(out["temperature"]) == 1.0
    jax.random.uniform(out["rng"])  # a usable key
    with pytest.raises(ValueError, match="complex64"):
        pc.random_like({"z": jax.ShapeDtypeStruct((2,), jnp.complex64, sharding=placed)}, vocab_size=7)
