"""Check that jaxrl's LoRA exports load in transformers + PEFT and give jaxrl's logits (needs torch, transformers,
peft).

Not run by the test-suite (the project's tests never import torch). `make_lora_exports.py` writes the exports and
`expected.npz` and prints this script's command lines; run them in an environment with torch, transformers and
peft, from the repository root::

    /path/to/peft-venv/bin/python tests/data/hf/check_peft_load.py --base tests/data/hf/transformers5/qwen2 \
        --adapter /tmp/lora-exports/qwen2/adapter --merged /tmp/lora-exports/qwen2/hf \
        --expected /tmp/lora-exports/qwen2/expected.npz

Checks, with every model loaded by `AutoModelForCausalLM.from_pretrained(dtype=float32, attn_implementation=
"eager")`, run on `expected.npz`'s tokens / attention_mask / position_ids without a cache, and logits compared
with `expected.npz['logits']` (jaxrl's adapted policy) at positions with attention_mask == 1:

* `peft`: `peft.PeftModel.from_pretrained(base, ADAPTER)`: every `lora_A` / `lora_B` tensor of the adapter file
  is in the model, equal to the file's, and the model has no other LoRA weights; logits within `--atol`
  (default 1e-4). Reported beside: the base's own logits (the adapter disabled), which must differ from the
  expected ones by more than 100 x atol, or the comparison would say nothing about the adapters.
* `merged`: the merged checkpoint MERGED loads without missing or unexpected weights; logits within `--atol`;
  its weights against PEFT's own `merge_and_unload()` of the adapter (max abs difference, within `--atol`).

Prints one JSON object; exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import peft
import torch
import transformers
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM


def _load(path: str):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True)
    return model.eval(), {k: sorted(v) for k, v in info.items() if v}


def _logits(model, expected) -> np.ndarray:
    return model(input_ids=torch.from_numpy(expected["tokens"]),
                 attention_mask=torch.from_numpy(expected["attention_mask"]),
                 position_ids=torch.from_numpy(expected["position_ids"]), use_cache=False).logits.float().numpy()


def _max_diff(logits: np.ndarray, expected) -> float:
    valid = expected["attention_mask"].astype(bool)
    return float(np.abs(logits - expected["logits"])[valid].max())


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the HF checkpoint directory the adapters were trained on")
    ap.add_argument("--adapter", required=True, help="the PEFT adapter directory (models.lora_export.save_peft)")
    ap.add_argument("--merged", required=True, help="the merged HF directory (models.lora_export.save_merged)")
    ap.add_argument("--expected", required=True, help="expected.npz: tokens, attention_mask, position_ids, logits")
    ap.add_argument("--atol", type=float, default=1e-4)
    args = ap.parse_args()
    expected = np.load(args.expected)
    failures: list[str] = []
    result: dict = {"base": args.base, "adapter": args.adapter, "merged": args.merged, "atol": args.atol,
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "peft_version": peft.__version__}

    base, base_info = _load(args.base)
    model = peft.PeftModel.from_pretrained(base, args.adapter).eval()
    stored = load_file(f"{args.adapter}/adapter_model.safetensors")
    # PEFT stores `<module>.lora_A.weight`; in the model it is `<module>.lora_A.<adapter name>.weight`
    loaded = {k.replace(".default.weight", ".weight"): v for k, v in model.state_dict().items()
              if ".lora_A." in k or ".lora_B." in k}
    missing = sorted(set(stored) - set(loaded))
    extra = sorted(set(loaded) - set(stored))
    differ = sorted(k for k in set(stored) & set(loaded) if not np.array_equal(loaded[k].numpy(), stored[k]))
    if missing or extra or differ:
        failures.append("the adapter's weights are not what PEFT loaded")
    adapted = _max_diff(_logits(model, expected), expected)
    with model.disable_adapter():
        without = _max_diff(_logits(model, expected), expected)
    result["peft"] = {"config": model.peft_config["default"].to_dict(), "adapter_tensors": len(stored),
                      "missing_in_model": missing, "not_in_file": extra, "differ": differ,
                      "base_loading_info": base_info, "max_abs_diff_valid": adapted,
                      "adapter_disabled_max_abs_diff_valid": without}
    if not adapted <= args.atol:
        failures.append("PEFT logits differ from expected.npz")
    if not without > 100 * args.atol:
        failures.append("the adapters barely change the logits: the check would be vacuous")

    merged, merged_info = _load(args.merged)
    reference = model.merge_and_unload().state_dict()
    weights = merged.state_dict()
    weight_diff = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
    result["merged"] = {"loading_info": merged_info, "max_abs_diff_valid": _max_diff(_logits(merged, expected),
                                                                                      expected),
                        "same_weight_names_as_peft_merge": sorted(weights) == sorted(reference),
                        "weights_max_abs_diff_to_peft_merge": weight_diff}
    if merged_info:
        failures.append(f"the merged checkpoint loads with {merged_info}")
    if not result["merged"]["max_abs_diff_valid"] <= args.atol:
        failures.append("merged logits differ from expected.npz")
    if not result["merged"]["same_weight_names_as_peft_merge"] or not weight_diff <= args.atol:
        failures.append("merged weights differ from PEFT's merge_and_unload")

    result["failures"] = failures
    result["ok"] = not failures
    print(json.dumps(result, indent=2, sort_keys=True, default=sorted))  # PEFT keeps some sets
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
