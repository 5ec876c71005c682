"""`jaxrl plan` with `rl.lora.enabled`: the programs run the adapted policy, the resident state is the frozen base
(quantized for QLoRA), the adapters and their optimizer state, with no reference copy, and the full fine-tune of
the same model is planned beside it."""

from __future__ import annotations

import math
import os

import jax
import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test processes may hold libtpu's lock

from jaxrl.config import Config  # noqa: E402
from jaxrl.configlib import load_config  # noqa: E402
from jaxrl.models.lora import PROJECTIONS  # noqa: E402
from jaxrl.plan import planner, report  # noqa: E402
from jaxrl.plan.programs import dtype_bits, layout_for, model_config, step_programs  # noqa: E402
from jaxrl.plan.topology import mesh_for, tpu_topology  # noqa: E402

DEFAULT = "configs/default.yaml"
# The default recipe's tiny model on small shapes, with a KL term (so the full fine-tune keeps a reference)
TINY = ["plan.prompt_len=16", "rl.prompts_per_step=4", "rl.group_size=2", "rl.sampling.max_new_tokens=16",
        "rl.sampling.decode_segments=1", "eval.batch_size=8", "mesh.fsdp=2", "mesh.tensor=2", "rl.loss.kl_coef=0.05"]
RANK = 4


def _programs(*overrides: str):
    config = load_config(Config, DEFAULT, [*TINY, *overrides])
    layout = layout_for(config, mesh_for(tpu_topology("v5e:2x2"), config.mesh))
    return config, step_programs(config, layout)


def _elements(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * dtype_bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def test_lora_state_is_adapters_and_a_frozen_base_without_a_reference_copy():
    config, full = _programs()
    assert config.rl.loss.needs_ref_logp and "reference" in full.resident  # the full fine-tune keeps a copy
    _, lora = _programs("rl.lora.enabled=true", f"rl.lora.rank={RANK}")
    assert set(lora.resident) == {"policy", "optimizer", "frozen_base"}
    model = model_config(config)
    # every projection of every layer: A [in, rank] and B [rank, out]
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    h, m = model.hidden_size, model.intermediate_size
    per_layer = RANK * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + m) + (m + h))
    assert _elements(lora.resident["policy"]) == model.num_layers * per_layer
    assert _elements(lora.resident["frozen_base"]) == _elements(full.resident["policy"])
    # Adam's two moments of the adapters alone (and its counters)
    assert _elements(lora.resident["optimizer"]) < 3 * _elements(lora.resident["policy"])
    assert _elements(lora.resident["optimizer"]) >= 2 * _elements(lora.resident["policy"])
    # every program but the log-prob pass takes the adapted policy: the base is an argument, not beside it
    for program in lora.programs:
        assert "frozen_base" not in program.resident_elsewhere, program.name
    logprobs = next(p for p in lora.programs if p.name == "logprobs")
    assert logprobs.calls_per_step == 2 and "adapters off" in logprobs.note


def test_qlora_base_is_stored_in_int8_and_4_bits():
    _, fp = _programs("rl.lora.enabled=true")
    _, int8 = _programs("rl.lora.enabled=true", "rl.lora.quantize=int8")
    _, nf4 = _programs("rl.lora.enabled=true", "rl.lora.quantize=nf4")
    projections = [x for path, x in jax.tree_util.tree_leaves_with_path(int8.resident["frozen_base"])
                   if "qvalue" in jax.tree_util.keystr(path)]
    assert len(projections) == len(PROJECTIONS) * 2 and all(x.dtype == "int8" for x in projections)
    sizes = [_bytes(plans.resident["frozen_base"]) for plans in (nf4, int8, fp)]
    assert sizes[0] < sizes[1] < sizes[2]


@pytest.fixture(scope="module")
def train_step_plans():  # two train-step compiles: 7.7 s on the 2-core machine idle, 38 s under load 6
    """The LoRA recipe's train step planned on v5e:2x2 with the full fine-tune's beside it."""
    overrides = [*TINY, "rl.lora.enabled=true", "rl.lora.quantize=int8", f"rl.lora.rank={RANK}"]
    topology = tpu_topology("v5e:2x2")
    plan = planner.make_plan(load_config(Config, DEFAULT, overrides), topology, overrides=overrides,
                             only=["train_step"])
    return planner.with_full_fine_tune(plan, DEFAULT, overrides, topology)


@pytest.mark.slow
def test_the_full_fine_tune_is_planned_beside_the_lora_recipe(train_step_plans):
    plan = train_step_plans
    full = plan.full
    assert plan.lora.startswith(f"LoRA rank {RANK}") and "int8" in plan.lora and full.lora == ""
    assert full.overrides[-1] == "rl.lora.enabled=false" and [p.name for p in full.programs] == ["train_step"]
    assert plan.trained < full.trained == full.parameters
    assert plan.resident_bytes < full.resident_bytes
    # the train step's arguments: the int8 base and the adapters' state, against float32 weights and Adam's moments
    (lora_step,), (full_step,) = plan.programs, full.programs
    assert lora_step.argument_bytes < full_step.argument_bytes / 2
    text = report.table(plan)
    assert "resident frozen_base" in text and "peak train_step" in text and "LoRA / full" in text
    line = report.to_json(plan)
    assert line["lora"] == plan.lora and line["full_fine_tune"]["peak_bytes_per_chip"] == full.peak_bytes
    assert "reference" in line["full_fine_tune"]["resident_bytes_per_chip"]
    assert "reference" not in line["resident_bytes_per_chip"]
