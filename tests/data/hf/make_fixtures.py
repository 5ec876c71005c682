"""Build tiny random Hugging Face checkpoints plus reference outputs for the HF-import tests.

What it makes
-------------
For the installed ``transformers`` major version MAJOR, this writes
``<out>/transformers<MAJOR>/<fixture>/`` for each fixture below, and
``<out>/transformers<MAJOR>/fixtures.json`` (versions, seeds, file sizes, stats).

* ``llama3``: LlamaForCausalLM, untied head, hidden 48 (head_dim 12), llama3 RoPE scaling
  (factor 8, low/high_freq_factor 1/4, original_max_position_embeddings=32, so both the
  scaled and the smooth band change logits at T=40); saved SHARDED
  (``model-0000x-of-00004.safetensors`` + ``model.safetensors.index.json``).
* ``qwen2``: Qwen2ForCausalLM, tied head, q/k/v biases, rope_theta=1e6, no sliding window.
* ``qwen3``: Qwen3ForCausalLM, untied head, q/k RMSNorm, head_dim=16 with hidden_size=48
  and 4 heads (head_dim != hidden/heads).
* ``gemma3``: Gemma3ForCausalLM (Gemma3TextConfig), 4 layers sliding x3 + full
  (explicit ``layer_types``), sliding_window=8, query_pre_attn_scalar=24 (!= head_dim 16),
  global rope_theta=1e6 with linear scaling 2.0, local rope_theta=1e4,
  final_logit_softcapping=30, gelu_pytorch_tanh, tied head, RMSNorm weight stored as an
  offset (x * (1 + w)).  attn_logit_softcapping=50 is in the config, but transformers'
  Gemma3 attention (4.57 and 5.x) never passes it to the attention function, so the
  reference logits do NOT apply it (checked: setting it to None or 1.0 changes nothing).
* ``llama3_bf16``: llama3 architecture with tied head, weights saved in bfloat16 (single
  file); reference computed in float32 over the bf16-rounded weights.

Every parameter is re-randomised after construction (no default inits left):
linear weights ~ N(0, gain/sqrt(fan_in)), embeddings / lm_head scaled so logits have
std ~1-3, RMSNorm weights 1 + 0.1*randn (Llama/Qwen) or 0.1*randn (Gemma offset
convention), biases 0.05*randn.  Each fixture seeds ``torch.manual_seed`` and draws
parameters in sorted-name order, so weights are reproducible and (when parameter
names agree) identical across transformers versions.

Each fixture directory holds the ``save_pretrained`` output plus ``expected.npz``:

* ``tokens`` [2, 40] int64, random ids in [3, vocab); row 1 LEFT-padded by 5 with pad id 0
* ``attention_mask`` [2, 40] int64, ``position_ids`` [2, 40] = clamp(cumsum(mask) - 1, 0)
* ``logits`` [2, 40, vocab] float32 = model(tokens, attention_mask, position_ids), eager
  attention, float32, eval, no cache.  Logits at padded query positions are whatever
  transformers produces for fully-masked rows: compare only where attention_mask == 1.
* ``prompt`` [1, 8] int64 and ``generated`` [1, 40] int64: greedy ``generate`` of exactly
  32 new tokens (EOS disabled), asserted equal to the argmax chain of plain full forwards.
* ``greedy_margin_min``: min over the 32 steps of top1 - top2 logit (plain forwards); if it
  is < 1e-3 the seed is bumped so greedy comparisons cannot be flaky.

The script then reloads every directory with ``AutoModelForCausalLM.from_pretrained``
(float32) and asserts parameters and logits reproduce bit-exactly.

How to re-run (a few seconds per environment, CPU is fine)
--------------------------------------------------------
The project's own tests never import torch or transformers; they only read these files.
Regenerate in throw-away environments, one per transformers major version::

    python -m venv /tmp/hf5 && /tmp/hf5/bin/pip install torch transformers
    /tmp/hf5/bin/python tests/data/hf/make_fixtures.py --out tests/data/hf   # -> transformers5/

    python -m venv /tmp/hf4 && /tmp/hf4/bin/pip install torch "transformers>=4.57,<5"
    /tmp/hf4/bin/python tests/data/hf/make_fixtures.py --out tests/data/hf   # -> transformers4/

(CPU-only torch is enough: ``pip install torch --index-url https://download.pytorch.org/whl/cpu``.)
Output is deterministic: re-running with the same torch/transformers versions rewrites
byte-identical files (the npz zip entries use a fixed timestamp).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import os
import shutil
import sys
import time
import zipfile

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

MAJOR = int(transformers.__version__.split(".")[0])

VOCAB = 128
T = 40
PAD_LEFT = 5
PROMPT_LEN = 8
NEW_TOKENS = 32
MIN_MARGIN = 1e-3
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def _rope(theta: float, scaling: dict | None = None) -> dict:
    """Version-appropriate RoPE kwargs for a single (non per-layer-type) rope."""
    if MAJOR >= 5:
        params = {"rope_type": "default"} if scaling is None else dict(scaling)
        params["rope_theta"] = theta
        return {"rope_parameters": params}
    out: dict = {"rope_theta": theta}
    if scaling is not None:
        out["rope_scaling"] = dict(scaling)
    return out


def _llama3_config(tie: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,  # head_dim 12 -> one rotary frequency falls in the llama3 smooth band
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        **_rope(10000.0, LLAMA3_ROPE),
        **SPECIAL,
    )


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        **_rope(1e6),
        **SPECIAL,
    )


def _qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        head_dim=16,
        intermediate_size=48,  # keeps the directory < 250 KB
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        **_rope(1e6),
        **SPECIAL,
    )


def _gemma3_config():
    from transformers import Gemma3TextConfig

    if MAJOR >= 5:
        rope = {
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        }
    else:
        rope = {
            "rope_theta": 1e6,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_local_base_freq": 1e4,
        }
    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,  # keeps the directory < 250 KB
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        **rope,
        **SPECIAL,
    )


# name -> (config factory, seed, save dtype, max_shard_size, norm is offset (Gemma))
FIXTURES = {
    "llama3": (lambda: _llama3_config(tie=False), 1001, torch.float32, "60KB", False),
    "qwen2": (_qwen2_config, 2002, torch.float32, None, False),
    "qwen3": (_qwen3_config, 3003, torch.float32, None, False),
    "gemma3": (_gemma3_config, 4004, torch.float32, None, True),
    "llama3_bf16": (lambda: _llama3_config(tie=True), 5005, torch.bfloat16, None, False),
}


def randomise(model: torch.nn.Module, seed: int, gemma_norm: bool) -> None:
    """Overwrite every parameter with seeded random values (sorted-name order)."""
    torch.manual_seed(seed)
    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    hidden = cfg.hidden_size
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = p.shape
            if name.endswith("norm.weight"):
                v = 0.1 * torch.randn(shape)
                if not gemma_norm:
                    v = v + 1.0
            elif name.endswith(".bias"):
                v = 0.05 * torch.randn(shape)
            elif name.endswith("embed_tokens.weight"):
                # tied: doubles as the head -> same scale as lm_head below
                v = torch.randn(shape) * ((2.0 / math.sqrt(hidden)) if tied else 1.0)
            elif name.endswith("lm_head.weight"):
                v = torch.randn(shape) * (2.0 / math.sqrt(hidden))
            elif p.ndim == 2:
                gain = 1.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                v = torch.randn(shape) * (gain / math.sqrt(shape[1]))
            else:
                raise RuntimeError(f"unhandled parameter {name} {tuple(shape)}")
            p.copy_(v.to(p.dtype))


def make_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(seed)
    tokens = rng.randint(3, VOCAB, size=(2, T)).astype(np.int64)
    mask = np.ones((2, T), np.int64)
    tokens[1, :PAD_LEFT] = SPECIAL["pad_token_id"]
    mask[1, :PAD_LEFT] = 0
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int64)
    prompt = rng.randint(3, VOCAB, size=(1, PROMPT_LEN)).astype(np.int64)
    return {"tokens": tokens, "attention_mask": mask, "position_ids": pos, "prompt": prompt}


@torch.no_grad()
def forward_logits(model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    out = model(
        input_ids=torch.from_numpy(inputs["tokens"]),
        attention_mask=torch.from_numpy(inputs["attention_mask"]),
        position_ids=torch.from_numpy(inputs["position_ids"]),
        use_cache=False,
    )
    return out.logits.float().numpy()


@torch.no_grad()
def greedy(model, prompt: np.ndarray) -> tuple[np.ndarray, float]:
    """generate() with EOS disabled, checked against the argmax chain of plain forwards."""
    p = torch.from_numpy(prompt)
    gen = model.generate(
        p,
        attention_mask=torch.ones_like(p),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=SPECIAL["pad_token_id"],
        use_cache=True,
    )
    gen = gen.numpy().astype(np.int64)
    assert gen.shape == (1, PROMPT_LEN + NEW_TOKENS), gen.shape
    assert (gen[:, :PROMPT_LEN] == prompt).all()
    margin = math.inf
    for t in range(NEW_TOKENS):
        prefix = torch.from_numpy(gen[:, : PROMPT_LEN + t])
        last = model(input_ids=prefix, use_cache=False).logits[0, -1].float()
        top2 = torch.topk(last, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        nxt = int(torch.argmax(last))
        assert nxt == gen[0, PROMPT_LEN + t], (t, nxt, gen[0, PROMPT_LEN + t])
    return gen, margin


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """np.savez_compressed equivalent with fixed zip timestamps (byte-reproducible)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def build(name: str, out_dir: str) -> dict:
    make_config, base_seed, save_dtype, shard, gemma_norm = FIXTURES[name]
    for attempt in range(20):
        seed = base_seed + 100 * attempt
        config = make_config()
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        assert model.config._attn_implementation == "eager"
        model.eval()
        if config.tie_word_embeddings:
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        randomise(model, seed, gemma_norm)
        if save_dtype != torch.float32:
            # round the PARAMETERS to save_dtype (not the rotary buffers, which transformers
            # recomputes in float32 at load time), then compute the reference in float32
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(save_dtype).to(torch.float32))
        inputs = make_inputs(seed)
        logits = forward_logits(model, inputs)
        gen, margin = greedy(model, inputs["prompt"])
        if margin >= MIN_MARGIN:
            break
        print(f"[{name}] seed {seed}: greedy margin {margin:.2e} too small, re-seeding", flush=True)
    else:
        raise RuntimeError(f"{name}: no seed with greedy margin >= {MIN_MARGIN}")

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    save_kwargs = {"safe_serialization": True}
    if shard is not None:
        save_kwargs["max_shard_size"] = shard
    to_save = model if save_dtype == torch.float32 else copy.deepcopy(model).to(save_dtype)
    to_save.save_pretrained(out_dir, **save_kwargs)
    del to_save

    valid = inputs["attention_mask"].astype(bool)
    write_npz(
        os.path.join(out_dir, "expected.npz"),
        {
            **inputs,
            "logits": logits.astype(np.float32),
            "generated": gen,
            "greedy_margin_min": np.asarray(margin, np.float32),
        },
    )

    files = sorted(os.listdir(out_dir))
    for f in files:  # save_pretrained writes safetensors as 0600
        os.chmod(os.path.join(out_dir, f), 0o644)
    n_weight_files = sum(f.endswith(".safetensors") for f in files)
    if shard is not None:
        assert n_weight_files >= 2 and "model.safetensors.index.json" in files, files
    else:
        assert files.count("model.safetensors") == 1, files

    # ---- sanity check: reload from disk and reproduce -------------------------------
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    reloaded.eval()
    ref_sd, new_sd = model.state_dict(), reloaded.state_dict()
    assert set(ref_sd) == set(new_sd), set(ref_sd) ^ set(new_sd)
    for k in ref_sd:
        assert new_sd[k].dtype == torch.float32, (k, new_sd[k].dtype)
        assert torch.equal(ref_sd[k], new_sd[k]), f"{name}: reloaded {k} differs"
    re_logits = forward_logits(reloaded, inputs)
    diff = float(np.abs(re_logits - logits).max())
    assert diff <= 1e-6, (name, diff)
    re_gen, _ = greedy(reloaded, inputs["prompt"])
    assert (re_gen == gen).all()

    nparams = sum(p.numel() for p in model.parameters())
    return {
        "model_class": type(model).__name__,
        "seed": seed,
        "num_parameters": nparams,
        "saved_dtype": str(save_dtype).replace("torch.", ""),
        "greedy_margin_min": round(margin, 6),
        "logits_std_valid": round(float(logits[valid].std()), 4),
        "logits_absmax_valid": round(float(np.abs(logits[valid]).max()), 4),
        "reload_max_abs_logit_diff": diff,
        "files": {f: os.path.getsize(os.path.join(out_dir, f)) for f in files},
        "total_bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in files),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="subset of fixtures")
    args = ap.parse_args()
    torch.set_num_threads(1)  # deterministic reductions, and fast enough for these sizes
    root = os.path.join(args.out, f"transformers{MAJOR}")
    os.makedirs(root, exist_ok=True)
    meta_path = os.path.join(root, "fixtures.json")
    meta = {"fixtures": {}}
    if args.only and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
    meta["transformers"] = transformers.__version__
    meta["torch"] = torch.__version__.split("+")[0]
    meta["numpy"] = np.__version__
    t0 = time.time()
    for name in args.only or FIXTURES:
        t1 = time.time()
        info = build(name, os.path.join(root, name))
        meta["fixtures"][name] = info
        print(
            f"[{name}] seed={info['seed']} params={info['num_parameters']} "
            f"bytes={info['total_bytes']} logits_std={info['logits_std_valid']} "
            f"margin={info['greedy_margin_min']:.4f} ({time.time() - t1:.1f}s)",
            flush=True,
        )
    meta["fixtures"] = dict(sorted(meta["fixtures"].items()))
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"wrote {root} in {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
