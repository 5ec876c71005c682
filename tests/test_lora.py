"""LoRA and QLoRA adapters (`jaxrl.models.lora`, `rl.lora`): the adapted policy starts equal to its base, only the
adapters train, the base with adapters off is the KL reference, a quantized base stays close, and bad input is
refused by name."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import configlib, losses, models
from jaxrl.config import Config
from jaxrl.loop import adapters
from jaxrl.models import lora
from jaxrl.models.hf import CheckpointError
from jaxrl.sampling import SamplingConfig, sample
from jaxrl.train import completion_logprobs, copy_policy, init_train_state, make_optimizer, make_rl_step

from fake_devices import run_on_eight_devices
from hf_fixtures import FIXTURES

FAMILIES = ("llama3", "qwen2", "qwen3", "gemma3")
TINY = models.ModelConfig(vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          intermediate_size=96)


def _tokens(vocab: int, shape=(2, 12), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def _randomised(policy, scale=0.05):
    """`policy` with nonzero adapters, so that they change the output."""
    leaves, tree = jax.tree.flatten(policy.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return policy.replace(params=jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                                           for x, k in zip(leaves, keys)]))


@pytest.fixture(scope="module")
def fixture_policies():
    return {name: models.from_pretrained(os.path.join(FIXTURES, "transformers5", name)) for name in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_adapters_give_the_base_logits_exactly(fixture_policies, family):
    base = fixture_policies[family]
    adapted = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0), seed=0)
    assert len(lora.adapter_weights(adapted)) == 7 * base.config.num_layers  # every projection of every layer
    tokens = _tokens(base.config.vocab_size)
    forward = jax.jit(models.forward)
    np.testing.assert_array_equal(forward(adapted, tokens), forward(base, tokens))
    moved = _randomised(adapted)
    assert not np.allclose(forward(moved, tokens), forward(base, tokens), atol=1e-4)  # adapters do act
    np.testing.assert_array_equal(forward(lora.adapters_off(moved), tokens), forward(base, tokens))
    # the merged weights give the adapted policy's logits
    np.testing.assert_allclose(forward(lora.merged(moved, lora.LoraSpec(rank=4, alpha=8.0)), tokens),
                               forward(moved, tokens), atol=2e-5)


def test_targets_select_projections_by_name_or_path():
    assert lora.target_paths(TINY, ("q_proj", "v_proj")) == [
        "layers/0/self_attn/q_proj", "layers/0/self_attn/v_proj", "layers/1/self_attn/q_proj",
        "layers/1/self_attn/v_proj"]
    assert sorted(lora.target_paths(TINY, (r"layers/1/mlp/.*",))) == [
        "layers/1/mlp/down_proj", "layers/1/mlp/gate_proj", "layers/1/mlp/up_proj"]
    adapted = lora.add_adapters(models.init(TINY, 0), lora.LoraSpec(rank=2, alpha=2.0, targets=("o_proj",)), 0)
    assert sorted(lora.adapter_weights(adapted)) == ["layers/0/self_attn/o_proj", "layers/1/self_attn/o_proj"]
    a, b = lora.adapter_weights(adapted)["layers/0/self_attn/o_proj"]
    assert a.shape == (64, 2) and b.shape == (2, 64) and not np.any(b)


def _rl_batch(policy, rows=8, prompt_len=4, new=6):
    tokens = _tokens(policy.config.vocab_size, (rows, prompt_len + new), seed=3)
    prompt_valid = jnp.ones((rows, prompt_len), bool)
    logp, _ = jax.jit(completion_logprobs)(policy, tokens, prompt_valid)
    advantages = jnp.asarray(np.linspace(-1, 1, rows, dtype=np.float32))[:, None] * jnp.ones((1, new))
    return {"tokens": tokens, "prompt_valid": prompt_valid, "loss_mask": jnp.ones((rows, new), jnp.float32),
            "advantages": advantages, "old_logp": logp, "ref_logp": logp}


@pytest.mark.parametrize("quantize", [None, pytest.param("int8", marks=pytest.mark.slow)])  # int8: the mesh test
def test_only_the_adapters_train_and_the_base_survives_donation(quantize):
    base = models.init(TINY, 0)
    adapted = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0, quantize=quantize), seed=0)
    frozen_before = jax.tree.map(np.asarray, adapted.frozen)
    reference = lora.adapters_off(adapted)
    optimizer = make_optimizer(learning_rate=1e-2)
    state = init_train_state(copy_policy(adapted), optimizer)
    # the optimizer state is the adapters' alone: Adam's two moments per adapter array (and counters)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert len(moments) == 2 * len(jax.tree.leaves(adapted.params))
    loss = losses.policy_term("ppo_clip", ratio="token", aggregation="token-mean", eps_low=0.2, eps_high=0.2)
    loss = losses.combine(loss, losses.kl_term(coef=0.1, estimator="k3"))
    step = make_rl_step(optimizer, loss, donate=True)
    controls = losses.Controls(entropy_coef=jnp.float32(0.0), temperature=jnp.float32(1.0))
    batch = _rl_batch(adapted)
    for _ in range(2):  # a donating step twice: the base (shared with the reference) must still be there
        state, metrics = step(state, batch, controls, reference)
    assert float(metrics["skipped"]) == 0.0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.policy.frozen), frozen_before)
    b_after = [b for _, b in lora.adapter_weights(state.policy).values()]
    assert all(np.any(np.asarray(b)) for b in b_after)  # every adapter's B moved off zero
    tokens = batch["tokens"]
    jax.jit(models.forward)(reference, tokens).block_until_ready()  # the reference's arrays are alive


def test_gradients_reach_only_the_adapters():
    """Differentiating the adapted model with respect to everything: the base's gradients are exactly zero
    only because nothing asks for them; the train step asks for `params` (the adapters) alone."""
    adapted = lora.add_adapters(models.init(TINY, 0), lora.LoraSpec(rank=4, alpha=8.0), seed=0)
    tokens = _tokens(TINY.vocab_size)

    def loss(params, frozen):
        return jnp.sum(models.forward(adapted.replace(params=params, frozen=frozen), tokens) ** 2)

    grads = jax.grad(loss)(adapted.params, adapted.frozen)
    assert jax.tree.structure(grads) == jax.tree.structure(adapted.params)
    assert all(np.any(np.asarray(g)) for path, g in jax.tree_util.tree_leaves_with_path(grads)
               if "lora_b" in jax.tree_util.keystr(path))  # B gets a gradient at once; A once B is nonzero


def test_kl_to_the_reference_is_zero_at_step_zero(fixture_policies):
    base = fixture_policies["qwen2"]
    adapted = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0), seed=1)
    tokens = _tokens(base.config.vocab_size, (4, 10))
    prompt_valid = jnp.ones((4, 4), bool)
    logprobs = jax.jit(completion_logprobs)
    policy_logp, _ = logprobs(adapted, tokens, prompt_valid)
    ref_logp, _ = logprobs(lora.adapters_off(adapted), tokens, prompt_valid)
    base_logp, _ = logprobs(base, tokens, prompt_valid)
    np.testing.assert_array_equal(ref_logp, base_logp)
    for estimator in ("k1", "k2", "k3"):
        assert float(jnp.abs(losses.kl_estimate(policy_logp, ref_logp, estimator)).max()) == 0.0


@pytest.mark.parametrize("family", ["llama3", "qwen2", pytest.param("qwen3", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.slow)])
def test_int8_base_keeps_sampled_logprobs_within_005_nats(fixture_policies, family):
    """Mean over sampled tokens of |log p_int8 - log p_float32| below 0.05 nats: 256 completion tokens sampled at
    temperature 1 from the float32 base, each scored in the context it was sampled in. (The largest single-token
    gap is no property of the int8 format: it grows with the number of tokens looked at, benchmarks/RESULTS.md;
    0.25 here only catches a broken quantization.)"""
    base = fixture_policies[family]
    prompts = _tokens(base.config.vocab_size, (8, 6), seed=5)
    config = SamplingConfig(max_new_tokens=16, temperature=1.0)
    rollout = sample(base, prompts, jnp.ones(prompts.shape, bool), jax.random.key(0), config, eos_id=-1, pad_id=0,
                     group_size=2)
    assert rollout.completion_mask.shape == (16, 16) and bool(rollout.completion_mask.all())  # no EOS: all sampled
    logprobs = jax.jit(completion_logprobs)
    exact, _ = logprobs(base, rollout.tokens, rollout.prompt_valid)
    qlora = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0, quantize="int8"), seed=0)
    assert {x.dtype for x in jax.tree.leaves(qlora.frozen) if x.ndim == 2 and x.shape[1] > 1} >= {jnp.dtype("int8")}
    quantized, _ = logprobs(qlora, rollout.tokens, rollout.prompt_valid)
    gap = jnp.abs(quantized - exact)
    assert 0.0 < float(gap.mean()) < 0.05 and float(gap.max()) < 0.25, (float(gap.mean()), float(gap.max()))


def test_the_logprob_gap_is_over_the_completion_tokens_alone(fixture_policies):
    """`adapters._logprob_gap` (what a QLoRA run reports before RL): zero for unquantized zero adapters, and
    for an int8 base the statistics of |log p_int8 - log p_base| over the tokens the mask marks, no others."""
    base = fixture_policies["qwen2"]
    tokens, prompt_valid = _tokens(base.config.vocab_size, (4, 14), seed=2), jnp.ones((4, 6), bool)
    mask = jnp.arange(8)[None, :] < jnp.array([[8], [3], [0], [5]])  # ragged completions, one empty
    same = adapters._logprob_gap(base, lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0), 0), tokens,
                                 prompt_valid, mask, 1.0)
    assert float(same["logprob_gap/max"]) == 0.0 and int(same["logprob_gap/tokens"]) == 16
    qlora = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0, quantize="int8"), 0)
    gap = adapters._logprob_gap(base, qlora, tokens, prompt_valid, mask, 0.7)
    logprobs = jax.jit(completion_logprobs)
    expected = np.abs(np.asarray(logprobs(qlora, tokens, prompt_valid, 0.7)[0] - logprobs(base, tokens, prompt_valid,
                                                                                             0.7)[0]))[np.asarray(mask)]
    np.testing.assert_allclose(float(gap["logprob_gap/mean"]), expected.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(gap["logprob_gap/max"]), expected.max(), rtol=1e-5)
    np.testing.assert_allclose(float(gap["logprob_gap/p99"]), np.quantile(expected, 0.99), rtol=1e-5)


def test_bad_lora_input_is_refused_by_name():
    with pytest.raises(ValueError, match="target 'qkv_proj' matches no projection.*q_proj, k_proj, v_proj, o_proj"):
        lora.add_adapters(models.init(TINY, 0), lora.LoraSpec(rank=4, alpha=8.0, targets=("qkv_proj",)), 0)
    with pytest.raises(ValueError, match="rank must be positive"):
        lora.LoraSpec(rank=0, alpha=1.0)
    base = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")
    cases = {"rl.lora.rank=0": "rl.lora.rank: must be > 0",
             "rl.lora.dropout=0.1": "lora.dropout is 0.1; only 0 is supported",
             "rl.lora.quantize=int3": "rl.lora.quantize"}
    for override, message in cases.items():
        with pytest.raises((ValueError, configlib.ConfigError), match=message):
            configlib.load_config(Config, base, ["rl.lora.enabled=true", override])
    with pytest.raises((ValueError, configlib.ConfigError), match="critic.model 'policy_copy'.*'separate'"):
        configlib.load_config(Config, base, ["rl.lora.enabled=true", "rl.critic.model=policy_copy",
                                             "rl.loss.advantage.estimator=gae"])
    config = configlib.load_config(Config, base, ["rl.lora.enabled=true", "rl.lora.targets=[attn]"])
    with pytest.raises(ValueError, match="rl.lora.targets: target 'attn' matches no projection"):
        adapters.adapt(config, models.init(config.model, 0))
    with pytest.raises(ValueError, match="already has adapters"):
        lora.add_adapters(lora.add_adapters(models.init(TINY, 0), lora.LoraSpec(rank=1, alpha=1.0), 0),
                          lora.LoraSpec(rank=1, alpha=1.0), 0)


def test_resume_refuses_another_base(tmp_path):
    base = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")
    config = configlib.load_config(Config, base, ["rl.lora.enabled=true", f"output_dir={tmp_path}"])
    policy = models.init(config.model, 0)
    adapted = adapters.start(config, policy)
    assert lora.is_adapted(adapted)
    record = json.loads((tmp_path / adapters.BASE_RECORD).read_text())
    assert record["saved"] and record["name"] == str(tmp_path / adapters.BASE_DIR)
    restored = adapters.resume_base(config, policy)  # from the saved copy, checked
    jax.tree.map(np.testing.assert_array_equal, restored.params, policy.params)
    other = models.init(config.model, 1)
    models.save_pretrained(other, tmp_path / adapters.BASE_DIR, progress=False)  # the saved base replaced
    with pytest.raises(CheckpointError, match="is not the one the run's adapters were trained on"):
        adapters.resume_base(config, policy)
    record["name"] = "/elsewhere/base"
    (tmp_path / adapters.BASE_RECORD).write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="trained on the base '/elsewhere/base'"):
        adapters.resume_base(config, policy)


def test_adapters_follow_the_logical_rules_on_a_mesh():
    run_on_eight_devices("""
import jax, jax.numpy as jnp, numpy as np
from jaxrl import models
from jaxrl.models import lora
from jaxrl.sharding import layout_from
from jaxrl.config import MeshConfig
config = models.ModelConfig(vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=96)
base = models.init(config, 0)
adapted = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0), 0)
adapted = adapted.replace(params=jax.tree.map(lambda x: x + 0.01, adapted.params))
layout = layout_from(MeshConfig(data=2, fsdp=2, tensor=2))
sharded = models.shard(adapted, layout)
a = sharded.params["layers"][0]["self_attn"]["q_proj"]["weight_lora_a"][...]
b = sharded.params["layers"][0]["self_attn"]["q_proj"]["weight_lora_b"][...]
assert a.sharding.spec == jax.sharding.PartitionSpec("fsdp"), a.sharding.spec  # [embed, rank]
assert b.sharding.spec == jax.sharding.PartitionSpec(None, "tensor"), b.sharding.spec  # [rank, heads]
w = sharded.frozen["layers"][0]["self_attn"]["q_proj"]["weight"][...]
assert w.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp"), w.sharding.spec
tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, 32)
np.testing.assert_allclose(jax.jit(models.forward)(sharded, tokens), jax.jit(models.forward)(adapted, tokens),
                           atol=2e-5)
print("OK")
""")


@pytest.mark.slow
def test_an_rl_step_of_adapters_on_a_mesh_equals_one_device():
    run_on_eight_devices("""
import jax, jax.numpy as jnp, numpy as np
from jaxrl import models
from jaxrl.models import lora
from jaxrl.sharding import layout_from
from jaxrl.config import MeshConfig
config = models.ModelConfig(vocab_size=32, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            intermediate_size=96)
base = models.init(config, 0)
layout = layout_from(MeshConfig(data=2, fsdp=2, tensor=2))
# two RL steps on the mesh (a quantized base too) equal the steps on one device
from jaxrl import losses
from jaxrl.train import completion_logprobs, init_train_state, make_optimizer, make_rl_step
from jaxrl.sharding import shard_batch
for quantize in (None, "int8"):
    one = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8.0, quantize=quantize), 0)
    many = models.shard(one, layout)
    tokens = jax.random.randint(jax.random.key(1), (8, 10), 0, 32)
    prompt_valid = jnp.ones((8, 4), bool)
    logp, _ = jax.jit(completion_logprobs)(one, tokens, prompt_valid)
    batch = {"tokens": tokens, "prompt_valid": prompt_valid, "loss_mask": jnp.ones((8, 6), jnp.float32),
             "advantages": jnp.linspace(-1.0, 1.0, 8)[:, None] * jnp.ones((1, 6)), "old_logp": logp}
    optimizer = make_optimizer(learning_rate=1e-2)
    step = make_rl_step(optimizer, losses.policy_term("ppo_clip"), donate=True)
    controls = losses.Controls(entropy_coef=jnp.float32(0.0), temperature=jnp.float32(1.0))
    results = []
    for policy, placed in ((one, batch), (many, shard_batch(batch, layout.mesh))):
        state = init_train_state(policy.replace(params=jax.tree.map(jnp.copy, policy.params)), optimizer)
        for _ in range(2):
            state, _ = step(state, placed, controls)
        results.append(jax.tree.map(np.asarray, state.policy.params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), *results)
    assert any(np.any(b) for _, b in lora.adapter_weights(state.policy).values())
print("OK")
""")


def test_lora_run_from_a_hugging_face_checkpoint_exports_and_refuses_another_base(tmp_path):
    """A QLoRA (int8) run on the tiny Qwen2 checkpoint: checkpoints hold the adapters alone, the exports are the
    adapted policy, and resuming on a changed base is refused."""
    import orbax.checkpoint as ocp
    from jaxrl import loop
    from test_pretrained_run import _checkpoint_with_tokenizer, _prompt_files

    _checkpoint_with_tokenizer(tmp_path / "qwen")
    _prompt_files(tmp_path, num_train=16, num_eval=4)
    overrides = [
        f"pretrained.path={tmp_path / 'qwen'}", "pretrained.dtype=float32", f"data.train_file={tmp_path / 'train.jsonl'}",
        f"data.eval_file={tmp_path / 'eval.jsonl'}", "data.reference_pattern='#### (.+)$'", "sft.steps=0",
        "rl.steps=2", "rl.prompts_per_step=4", "rl.group_size=4", "rl.sampling.max_new_tokens=8", "eval.every=0",
        "eval.batch_size=4", "checkpoint.every=2", "reward.function=math", "progress=false",
        f"output_dir={tmp_path / 'run'}", "pretrained.attention_impl=xla", "rl.lora.enabled=true", "rl.lora.rank=4",
        "rl.lora.quantize=int8", "rl.loss.kl_coef=0.05", "rl.optim.learning_rate=0.01",
        "rl.loss.entropy_coef=0.01",  # a gradient even when every completion gets the same reward
    ]
    summary = loop.run(configlib.load_config(Config, None, overrides))
    run = tmp_path / "run"
    # before RL, the run measured what quantizing the base did, and says so in the metrics and the summary
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (quantized,) = [r for r in records if r["phase"] == adapters.QUANTIZED_PHASE]
    assert 0 < quantized["logprob_gap/mean"] <= quantized["logprob_gap/p99"] <= quantized["logprob_gap/max"] < 1
    assert quantized["logprob_gap/tokens"] > 0 and quantized["eval/num_problems"] == 4
    assert summary["accuracy_quantized_start"] == quantized["eval/accuracy"]
    assert summary["quantization_logprob_gap_mean"] == quantized["logprob_gap/mean"]
    assert adapters.recorded_quantized_start(str(run / "metrics.jsonl")) == {
        k: v for k, v in quantized.items() if k not in ("phase", "step")}
    record = json.loads((run / adapters.BASE_RECORD).read_text())
    assert record["name"] == str(tmp_path / "qwen") and not record["saved"]  # the base is the checkpoint itself
    manager = ocp.CheckpointManager(run / "checkpoints")
    saved = manager.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    manager.close()
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved["params"])]
    assert names and all("lora" in n for n in names)  # adapters only, no base weights
    assert all("lora" in jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(saved["ref_params"]))
    # the exports are the trained adapted policy: merged, and as PEFT files
    base = models.from_pretrained(tmp_path / "qwen", progress=False)
    trained = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=16.0, quantize="int8"), seed=0)
    leaves = [np.asarray(x) for x in jax.tree.leaves(saved["params"])]
    trained = trained.replace(params=jax.tree.unflatten(jax.tree.structure(trained.params), leaves))
    assert any(np.any(b) for _, b in lora.adapter_weights(trained).values())
    tokens = _tokens(base.config.vocab_size)
    merged = models.from_pretrained(run / "hf", progress=False)
    np.testing.assert_allclose(jax.jit(models.forward)(merged, tokens), jax.jit(models.forward)(trained, tokens),
                               atol=1e-4)
    assert (run / "adapter" / "adapter_model.safetensors").exists()
    # `jaxrl eval` / `convert` / `pretrained.path` read the run as its adapters merged into the base
    from jaxrl.policy_io import load_policy
    loaded = load_policy(run)
    assert loaded.frozen is None
    np.testing.assert_allclose(jax.jit(models.forward)(loaded, tokens), jax.jit(models.forward)(merged, tokens),
                               atol=1e-5)
    # resuming on the same path with other weights: refused
    weights = tmp_path / "qwen" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # zero the last two float32 values of the last tensor
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is not the one the run's adapters were trained on"):
        loop.run(configlib.load_config(Config, None, [*overrides, "rl.steps=4", "resume=true"]))


@pytest.mark.slow
def test_a_resumed_lora_run_equals_the_uninterrupted_one(tmp_path):
    """The default recipe (shortened) with LoRA and a KL reference: 2 steps, then resumed to 4, gives the records
    of 4 steps run at once (the base is the run's warm start, saved in the run and checked on resume)."""
    from jaxrl import loop
    base = os.path.join(os.path.dirname(__file__), "..", "configs", "default.yaml")
    common = ["sft.steps=30", "eval.every=2", "checkpoint.every=2", "rl.lora.enabled=true", "rl.loss.kl_coef=0.01",
              "progress=false", "task.num_eval=32"]
    loop.run(configlib.load_config(Config, base, [*common, "rl.steps=4", f"output_dir={tmp_path / 'once'}"]))
    loop.run(configlib.load_config(Config, base, [*common, "rl.steps=2", f"output_dir={tmp_path / 'twice'}"]))
    loop.run(configlib.load_config(Config, base, [*common, "rl.steps=4", f"output_dir={tmp_path / 'twice'}",
                                                  "resume=true"]))

    def records(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {(r["phase"], r["step"]): {k: v for k, v in r.items() if "time" not in k and not k.endswith("_s")
                                          and k != "sampler/compiled_programs"}
                for r in rows if r["phase"] == "rl" and r["step"] in (3, 4) and not r.get("final")}

    assert records("once") == records("twice")


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_rematerialised_adapters_give_the_same_gradients(remat):
    tokens = _tokens(TINY.vocab_size, (2, 10))
    prompt_valid = jnp.ones((2, 4), bool)
    grads = []
    for config in (TINY, dataclasses.replace(TINY, remat=remat)):
        adapted = _randomised(lora.add_adapters(models.init(config, 0), lora.LoraSpec(rank=4, alpha=8.0), 0))

        def loss(params, adapted=adapted):
            return completion_logprobs(adapted.replace(params=params), tokens, prompt_valid)[0].sum()

        grads.append(jax.jit(jax.grad(loss))(adapted.params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *grads)


@pytest.mark.parametrize("adapted", [True, False])
def test_remat_full_lowers_the_backward_pass_memory(adapted):
    """`remat="full"` keeps only each block's input for the backward pass, on XLA's CPU compiler too: with
    `jax.checkpoint` the CPU compiler merged the recomputation into the forward pass, and an adapted step's
    compiled temporaries did not fall at all (289.5 against 291.1 MiB, 32 x 128 tokens of the tiny preset).
    Here 4 layers over 16 x 96 tokens, where the activations dominate: keeping only the block inputs takes
    the gradient's temporaries to well under half, with adapters and without."""
    config = dataclasses.replace(TINY, num_layers=4)
    tokens = _tokens(config.vocab_size, (16, 96))
    prompt_valid = jnp.ones((16, 32), bool)
    temps = {}
    for remat in ("none", "full"):
        policy = models.init(dataclasses.replace(config, remat=remat), 0)
        if adapted:
            policy = lora.add_adapters(policy, lora.LoraSpec(rank=4, alpha=8.0), 0)

        def loss(params, policy=policy):
            return completion_logprobs(policy.replace(params=params), tokens, prompt_valid)[0].sum()

        compiled = jax.jit(jax.grad(loss)).lower(policy.params).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temps["full"] < 0.5 * temps["none"], temps
