"""`jaxrl bench train --lora`: the train step with LoRA adapters beside the full step on a tiny model; the
adapted step trains the adapters alone and needs less memory; bad flag combinations exit 2 before anything runs."""

import json

import pytest

from jaxrl import bench, cli, models

ARGV = ["bench", "train", "--model", "tiny", "--sequences", "2", "--prompt-len", "4", "--completion-len", "4",
        "--repeats", "1"]
RANK = 2


# one layer, hidden 32: the smallest model whose step has every projection
TINY = models.ModelConfig(vocab_size=48, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          intermediate_size=64)


@pytest.fixture(scope="module")
def comparison():
    return bench.compare_lora(RANK, quantize="int8", model=TINY, sequences=2, prompt_len=4, completion_len=4,
                              repeats=1)


def test_lora_step_trains_the_adapters_alone_in_less_memory(comparison):
    full, lora = comparison["full"], comparison["lora"]
    config = TINY
    assert full["lora"] is None and full["trainable_parameters"] == models.num_parameters(config)
    h, m = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + m) + (m + h)  # A [in, r] + B [r, out], 7 projections
    assert lora["trainable_parameters"] == RANK * per_layer * config.num_layers
    assert lora["lora"] == {"rank": RANK, "alpha": 2.0 * RANK, "targets": list(lora["lora"]["targets"]),
                            "quantize": "int8", "frozen_bytes": lora["lora"]["frozen_bytes"]}
    assert len(lora["lora"]["targets"]) == 7
    # the int8 base: a byte per projection weight (and a float32 scale per output row), float32 embeddings
    assert lora["lora"]["frozen_bytes"] < 4 * models.num_parameters(config)
    for r in (full, lora):
        assert r["step_memory_bytes"] == r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]
        assert r["step_s"] > 0 and r["sequences"] == 2 and r["donate"]
    # no gradient and no Adam moments for the base: the step's arguments shrink by more than half
    assert lora["argument_bytes"] < full["argument_bytes"] / 2
    assert comparison["step_memory_ratio"] == pytest.approx(lora["step_memory_bytes"] / full["step_memory_bytes"])
    assert comparison["step_memory_ratio"] < 0.75
    assert comparison["speedup_tokens_per_s"] == pytest.approx(lora["tokens_per_s"] / full["tokens_per_s"])
    (full_s, lora_s), = comparison["interleaved_step_s"]  # repeats=1: one round
    assert full_s > 0 and lora_s > 0 and comparison["speedup_interleaved"] == pytest.approx(full_s / lora_s)


def test_cli_bench_train_lora_prints_both_steps(capsys, monkeypatch, comparison):
    calls = []
    monkeypatch.setattr(bench, "compare_lora", lambda *a, **kw: calls.append((a, kw)) or comparison)
    assert cli.main([*ARGV, "--lora", str(RANK), "--quantize", "int8"]) == 0
    (args, kwargs), = calls
    assert args == (RANK,) and kwargs["quantize"] == "int8" and kwargs["lora_targets"] is None
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[0])["benchmark"] == "train_lora"
    assert any(line.startswith("| full fine-tune |") for line in lines)
    assert any(line.startswith(f"| LoRA rank {RANK} (alpha {2 * RANK}) on all projections, int8 base (QLoRA) |")
               for line in lines)
    assert any(line.startswith("LoRA / full compiled step memory: ") for line in lines)


def test_lora_flags_parse():
    args = cli.build_parser().parse_args([*ARGV, "--lora", "8", "--lora-targets", "q_proj", "v_proj",
                                          "--lora-alpha", "4", "--quantize", "nf4"])
    assert (args.lora, args.lora_targets, args.lora_alpha, args.quantize) == (8, ["q_proj", "v_proj"], 4.0, "nf4")


@pytest.mark.parametrize("extra, message", [
    (["--quantize", "int8"], "need --lora RANK"),
    (["--lora", "0"], "rank must be positive"),
    (["--lora", "2", "--lora-targets", "nothing_proj"], "matches no projection"),
    (["--lora", "2", "--packing", "compare"], "use --packing on or off"),
])
def test_cli_bench_train_lora_errors(capsys, monkeypatch, extra, message):
    monkeypatch.setattr(bench, "bench_train", lambda **_: pytest.fail("ran a benchmark despite bad flags"))
    assert cli.main([*ARGV, *extra]) == 2
    assert message in capsys.readouterr().err
