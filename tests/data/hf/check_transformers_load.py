"""Check that a checkpoint directory loads in Hugging Face transformers (needs torch + transformers).

Not run by the test-suite (the project's tests never import torch).  Use it to verify that a
directory written by our own ``save_pretrained`` round-trips through transformers::

    /path/to/hf-venv/bin/python tests/data/hf/check_transformers_load.py OUT_DIR \
        --reference tests/data/hf/transformers5/llama3

It loads DIR with ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32, attn_implementation="eager")``.
With ``--reference FIXTURE_DIR`` it additionally

* loads the reference checkpoint the same way and asserts every ``state_dict`` entry
  (tied entries included) is bit-identical after the float32 upcast,
* runs DIR's model on the reference's ``expected.npz`` tokens / attention_mask / position_ids
  and asserts the logits match ``expected.npz['logits']`` within ``--atol`` (default 1e-5) at
  positions with attention_mask == 1 (padded query rows are reported, not asserted),
* re-runs the greedy ``generate`` and compares it with ``expected.npz['generated']``.

Prints one JSON object; exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM


def _load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _stored_dtypes(path: str) -> dict[str, int]:
    """Count of tensors per stored dtype, read from the safetensors headers."""
    counts: dict[str, int] = {}
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for key, meta in header.items():
            if key != "__metadata__":
                counts[meta["dtype"]] = counts.get(meta["dtype"], 0) + 1
    return counts


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="checkpoint directory to load")
    ap.add_argument("--reference", help="fixture directory (a tests/data/hf/transformers*/<fixture>)")
    ap.add_argument("--atol", type=float, default=1e-5)
    args = ap.parse_args()

    model = _load(args.dir)
    result: dict = {
        "dir": args.dir,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_class": type(model).__name__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "stored_dtypes": _stored_dtypes(args.dir),
        "files": sorted(os.listdir(args.dir)),
        "ok": True,
    }
    failures: list[str] = []

    if args.reference:
        ref = _load(args.reference)
        result["reference"] = args.reference
        sd, ref_sd = model.state_dict(), ref.state_dict()
        missing = sorted(set(ref_sd) - set(sd))
        extra = sorted(set(sd) - set(ref_sd))
        mismatched, max_abs = [], {}
        for k in sorted(set(sd) & set(ref_sd)):
            a, b = sd[k], ref_sd[k]
            if a.shape != b.shape or a.dtype != b.dtype:
                mismatched.append(f"{k}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
                continue
            # bit-level comparison (distinguishes -0.0 / NaN payloads too)
            if not torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)):
                mismatched.append(k)
                max_abs[k] = float((a - b).abs().max())
        result["params"] = {
            "compared": len(set(sd) & set(ref_sd)),
            "missing": missing,
            "unexpected": extra,
            "mismatched": mismatched,
            "max_abs_diff": max_abs,
        }
        if missing or extra or mismatched:
            failures.append("parameters differ from reference")

        cfg_a, cfg_b = model.config.to_dict(), ref.config.to_dict()
        ignore = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}
        result["config_diff"] = {
            k: [cfg_a.get(k), cfg_b.get(k)]
            for k in sorted(set(cfg_a) | set(cfg_b))
            if k not in ignore and cfg_a.get(k) != cfg_b.get(k)
        }

        exp_path = os.path.join(args.reference, "expected.npz")
        if os.path.exists(exp_path):
            exp = np.load(exp_path)
            logits = model(
                input_ids=torch.from_numpy(exp["tokens"]),
                attention_mask=torch.from_numpy(exp["attention_mask"]),
                position_ids=torch.from_numpy(exp["position_ids"]),
                use_cache=False,
            ).logits.float().numpy()
            valid = exp["attention_mask"].astype(bool)
            diff = np.abs(logits - exp["logits"])
            result["logits"] = {
                "max_abs_diff_valid": float(diff[valid].max()),
                "max_abs_diff_all": float(diff.max()),
                "atol": args.atol,
            }
            if not diff[valid].max() <= args.atol:
                failures.append("logits differ from expected.npz")

            prompt = torch.from_numpy(exp["prompt"])
            new = exp["generated"].shape[1] - prompt.shape[1]
            gen = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            ).numpy()
            same = gen.shape == exp["generated"].shape and bool((gen == exp["generated"]).all())
            result["generate_matches"] = same
            if not same:
                failures.append("greedy generation differs from expected.npz")
        else:
            result["logits"] = "no expected.npz in reference"

    result["failures"] = failures
    result["ok"] = not failures
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
