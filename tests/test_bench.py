"""`jaxrl bench sample`: the sampler benchmark on a tiny model returns sane figures; the CLI prints JSON."""

import json
import math
import os

import pytest

from jaxrl import models
from jaxrl import bench, cli

TINY = models.ModelConfig(vocab_size=48, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          intermediate_size=64)
SIZES = dict(prompts=2, prompt_len=5, group=3, new_tokens=4, repeats=2)
FIGURES = ("compile_s", "first_call_s", "call_s", "tokens_per_s", "ttft_s", "peak_memory_bytes")


def _check(result, prompts, group, new_tokens, repeats, prompt_len=None):
    assert result["sequences"] == prompts * group and result["prompts"] == prompts and result["group"] == group
    assert prompt_len is None or result["prompt_len"] == prompt_len
    assert result["generated_tokens"] == prompts * group * new_tokens
    for key in FIGURES:
        assert math.isfinite(result[key]) and result[key] >= 0, (key, result[key])
    for key in ("call_s", "tokens_per_s", "ttft_s", "peak_memory_bytes", "first_call_s"):
        assert result[key] > 0, key
    assert len(result["call_times_s"]) == len(result["ttft_times_s"]) == repeats
    assert result["tokens_per_s"] == pytest.approx(result["generated_tokens"] / result["call_s"])
    assert result["jax_version"] and result["device_kind"]


def test_bench_sample_both_modes_tiny_config():
    result = bench.compare_sample(isolate=False, model=TINY, **SIZES)
    shared, baseline = result["prefix_sharing"], result["baseline"]
    for r in (shared, baseline):
        _check(r, **SIZES)
        assert r["model"] == "custom" and r["parameters"] == models.num_parameters(TINY)
    assert shared["prefix_sharing"] is True and baseline["prefix_sharing"] is False
    assert result["speedup_tokens_per_s"] > 0 and result["speedup_ttft"] > 0


def test_bench_sample_rejects_bad_sizes():
    with pytest.raises(ValueError, match="group"):
        bench.bench_sample(TINY, group=0)
    with pytest.raises(ValueError, match="unknown model"):
        bench.bench_sample("no-such-model")


def test_cli_bench_sample_prints_a_json_line(capsys):
    argv = ["bench", "sample", "--model", "tiny", "--prompts", "2", "--prompt-len", "8", "--group", "2",
            "--new-tokens", "4", "--repeats", "1"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[0])
    _check(result, prompts=2, group=2, new_tokens=4, repeats=1, prompt_len=8)
    assert result["model"] == "tiny" and result["prefix_sharing"] is True
    assert any(line.startswith("| mode |") for line in lines)

    args = cli.build_parser().parse_args([*argv, "--no-prefix-sharing"])
    assert args.no_prefix_sharing and not args.compare and args.handler is cli._bench_sample


def test_cli_bench_sample_errors(capsys):
    assert cli.main(["bench", "sample", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --compare and --no-prefix-sharing exclude each other
        cli.main(["bench", "sample", "--compare", "--no-prefix-sharing"])



def test_bench_train_tiny_config_and_cli(capsys):
    result = bench.bench_train(model=TINY, sequences=4, prompt_len=5, completion_len=6, micro_batches=2, repeats=2)
    assert result["benchmark"] == "train" and result["parameters"] == models.num_parameters(TINY)
    for key in ("compile_s", "first_step_s", "step_s", "tokens_per_s", "peak_memory_bytes"):
        assert math.isfinite(result[key]) and result[key] >= 0, (key, result[key])
    assert result["tokens_per_s"] == pytest.approx(4 * 11 / result["step_s"]) and len(result["step_times_s"]) == 2
    # The loop's donated state is written in place: the step needs the state's size (params + Adam's two
    # moments, float32) less than when the input state is kept.
    kept = bench.bench_train(model=TINY, sequences=4, prompt_len=5, completion_len=6, micro_batches=2, repeats=1,
                             donate=False)
    assert result["donate"] and not kept["donate"]
    state_bytes = 3 * 4 * models.num_parameters(TINY)
    assert kept["step_memory_bytes"] - result["step_memory_bytes"] >= state_bytes
    with pytest.raises(ValueError, match="divisible by micro_batches"):
        bench.bench_train(model=TINY, sequences=3, micro_batches=2)

    argv = ["bench", "train", "--preset", "tiny", "--sequences", "2", "--prompt-len", "4", "--completion-len", "4",
            "--repeats", "1"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[0])
    assert result["model"] == "tiny" and result["sequences"] == 2 and result["tokens_per_s"] > 0
    assert any(line.startswith("| model |") for line in lines)
    assert cli.main(["bench", "train", "--preset", "tiny", "--sequences", "0"]) == 2
    assert cli.main(["bench", "train", "--preset", "tiny", "--mesh", "1,1"]) == 2
    assert "expected three sizes" in capsys.readouterr().err


def test_bench_train_remat_bf16_and_mfu():
    """Rematerialised bf16 compute over float32 master weights: the same workload, its FLOPs and MFU."""
    result = bench.bench_train(model=TINY, sequences=2, prompt_len=4, completion_len=4, repeats=1, remat="full",
                               compute_dtype="bfloat16", peak_tflops=1.0)
    assert result["remat"] == "full" and result["dtype"] == "bfloat16" and result["param_dtype"] == "float32"
    assert result["mesh"] == [1, 1, 1]
    flops = bench.train_flops_per_token(TINY, 8)
    c = TINY
    params = c.num_layers * (c.hidden_size * c.head_dim * 2 * (c.num_heads + c.num_kv_heads)
                             + 3 * c.hidden_size * c.intermediate_size) + c.vocab_size * c.hidden_size
    assert flops == 6 * params + 6 * c.num_layers * c.num_heads * c.head_dim * 8
    assert result["model_tflops_per_s"] == pytest.approx(flops * result["tokens_per_s"] / 1e12)
    assert result["mfu"] == pytest.approx(result["model_tflops_per_s"])


def test_bench_train_memory_only_compiles_without_running(capsys):
    """`--memory-only`: the same compiled step, so the same `memory_analysis()` figures as a timed run, and no
    step run or timed; with `--lora` both steps, and their ratio."""
    sizes = dict(model=TINY, sequences=4, prompt_len=5, completion_len=6, micro_batches=2, repeats=1,
                 remat="full")
    timed = bench.bench_train(**sizes)
    compiled = bench.bench_train(**sizes, memory_only=True)
    assert compiled["memory_only"] and compiled["step_memory_bytes"] > 0
    for key in ("step_memory_bytes", "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                "trainable_parameters", "parameters", "useful_tokens"):
        assert compiled[key] == timed[key], key
    for key in ("step_s", "first_step_s", "tokens_per_s", "useful_tokens_per_s", "peak_memory_bytes", "mfu"):
        assert compiled[key] is None, key
    assert compiled["step_times_s"] == [] and compiled["compile_s"] > 0

    argv = ["bench", "train", "--preset", "tiny", "--sequences", "2", "--prompt-len", "4", "--completion-len", "4",
            "--memory-only", "--lora", "2"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[0])
    full, lora = result["full"], result["lora"]
    assert full["memory_only"] and lora["memory_only"] and lora["lora"]["rank"] == 2
    assert result["step_memory_ratio"] == pytest.approx(lora["step_memory_bytes"] / full["step_memory_bytes"])
    assert result["interleaved_step_s"] == [] and result["speedup_interleaved"] is None
    assert any(line.startswith("| full fine-tune |") for line in lines)
    assert any(line.startswith("LoRA / full compiled step memory: ") for line in lines)


@pytest.mark.parametrize("mesh", ["1,x,1", "1,1,1,", ""])
def test_bench_train_a_malformed_mesh_is_named(capsys, mesh):
    assert cli.main(["bench", "train", "--preset", "tiny", "--mesh", mesh]) == 2
    assert f"--mesh {mesh!r}: expected three sizes" in capsys.readouterr().err  # not int()'s "invalid literal"


@pytest.mark.parametrize("peak", ["0", "-3", "nan", "inf"])
def test_bench_train_rejects_a_peak_that_gives_no_mfu_before_running(capsys, peak):
    """0 divided by zero after the whole run (a traceback); nan printed `"mfu": NaN`, which is not JSON."""
    assert cli.main(["bench", "train", "--preset", "tiny", "--repeats", "1", "--peak-tflops", peak]) == 2
    captured = capsys.readouterr()
    assert "peak_tflops must be a positive number" in captured.err and not captured.out


def _benchmark_script(name: str = "profile_decode"):
    """`benchmarks/<name>.py` as a module (benchmarks/ is not a package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _profile_decode():
    return _benchmark_script("profile_decode")


def test_compaction_profile_times_every_segment(capsys):
    """The segments of one compacted call: the batch shrinks as rows finish, and their times add up to the call."""
    from jaxrl import sampling

    result = _benchmark_script("compaction_profile").main(
        ["--model", "tiny", "--prompts", "2", "--group", "4", "--new-tokens", "64", "--segments", "4"])
    rows = [segment["rows"] for segment in result["segments"]]
    assert rows[0] == 8 and rows == sorted(rows, reverse=True) and rows[-1] < 8, rows
    assert [segment["end"] for segment in result["segments"]] == [16, 32, 48, 64][:len(rows)]
    assert sum(segment["seconds"] for segment in result["segments"]) <= result["call_s"]
    assert sampling._segment_program.__name__ == "_segment_program"  # the timing wrapper is gone
    assert "| segment end |" in capsys.readouterr().out


def _quantization_gap(schemes: str, capsys) -> tuple[dict, str]:
    fixture = os.path.join(os.path.dirname(__file__), "data", "hf", "transformers5", "qwen2")
    result = _benchmark_script("quantization_gap").main(
        [fixture, "--prompts", "2,4", "--new-tokens", "8", "--schemes", schemes, "--calibration", "2"])
    rows = {(r["scheme"], r["tokens"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((s, n) for s in schemes.split(",") for n in (32, 64))
    assert all(0 < r["mean"] <= r["p99"] <= r["max"] for r in rows.values())
    return rows, capsys.readouterr().out


def test_quantization_gap_measures_each_scheme_on_sampled_tokens(capsys):
    """The gap of an int8 base and of a 12-bit grid on the tiny Qwen2: a finer grid moves the sampled tokens'
    log-probs less, and the max is at least the 99th percentile, which is at least the mean."""
    rows, out = _quantization_gap("int8,rtn12", capsys)
    assert rows["rtn12", 64]["mean"] < rows["int8", 64]["mean"] / 4  # 4 bits finer: about 16x smaller steps
    assert "| qwen2 | rtn12 | 64 |" in out
    with pytest.raises(SystemExit):
        _benchmark_script("quantization_gap").main(["--schemes", "int3"])


@pytest.mark.slow  # GPTQ compiles a program per projection shape: about 30 s
def test_quantization_gap_rounds_with_gptq(capsys):
    rows, out = _quantization_gap("int4,gptq-int4", capsys)
    assert rows["gptq-int4", 64]["mean"] < rows["int4", 64]["mean"]  # error compensation helps at 4 bits
    assert "| qwen2 | gptq-int4 | 64 |" in out


def test_profile_decode_busy_time_and_one_step():
    profile = _profile_decode()
    assert profile.busy_ns([]) == 0
    assert profile.busy_ns([(5, 6), (0, 2), (1, 3)]) == 4  # [0, 3] and [5, 6]: overlaps counted once
    # 6 steps of (layer, layer, head); the head runs once per step and is the longest such kernel
    stream = [(name, 10.0 * i, duration, {}) for i, (name, duration) in
              enumerate([("layer", 2.0), ("layer", 2.0), ("head", 5.0)] * 6)]
    step = profile.one_step(stream, steps=6)
    assert [name for name, *_ in step] == ["layer", "layer", "head"]
    assert step[0][1] > 0  # from the middle of the call, not its start
    assert profile.one_step(stream, steps=100) == []  # no kernel runs once per step
