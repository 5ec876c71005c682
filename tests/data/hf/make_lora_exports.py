"""Write LoRA exports of the tiny HF fixtures, and jaxrl's logits for them, for `check_peft_load.py`.

Runs in the project's environment (jax, no torch)::

    JAX_PLATFORMS=cpu PYTHONPATH=. python tests/data/hf/make_lora_exports.py --out /tmp/lora-exports

For each case below it loads `tests/data/hf/transformers5/<fixture>` in float32 (`models.from_pretrained`),
adds rank-4 adapters (`models.lora.add_adapters`, alpha 8, so the scale is 2), replaces them with nonzero
random values (A ~ N(0, 1/in), B ~ N(0, 1/(4 rank)); zero-initialised B would make the check vacuous), and
writes under `<out>/<case>/`:

* `adapter/`: the PEFT adapter directory (`models.lora_export.save_peft`),
* `hf/`: the merged HF checkpoint (`models.lora_export.save_merged`, with the fixture as `base`),
* `expected.npz`: the fixture's `tokens` / `attention_mask` / `position_ids` [2, 40] (row 1 left-padded) and
  `logits` [2, 40, vocab] float32 of jaxrl's adapted policy (`models.forward`, no merge).

Cases: `qwen2` and `llama3`, every projection of every layer adapted (PEFT `target_modules` is the list of
projection names); `qwen2_partial`, only some projections of some layers (`target_modules` is the exact list
of module names). Then it prints, one a line, the command that checks each case in an environment with torch,
transformers and peft (`check_peft_load.py`).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import models
from jaxrl.models import lora, lora_export

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {  # case: (fixture, targets)
    "qwen2": ("qwen2", lora.PROJECTIONS),
    "llama3": ("llama3", lora.PROJECTIONS),
    "qwen2_partial": ("qwen2", ("layers/0/self_attn/(q|v)_proj", "layers/1/mlp/down_proj")),
}
RANK, ALPHA = 4, 8.0


def randomized(policy: models.Policy, seed: int) -> models.Policy:
    """`policy` with every adapter drawn anew: A [in, rank] ~ N(0, 1/in), B [rank, out] ~ N(0, 1/(4 rank))."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(policy.params)
    keys = jax.random.split(jax.random.key(seed), len(paths))
    drawn = []
    for key, (path, x) in zip(keys, paths):
        std = x.shape[0] ** -0.5 if "weight_lora_a" in jax.tree_util.keystr(path) else 0.5 * x.shape[0] ** -0.5
        drawn.append(jax.random.normal(key, x.shape, x.dtype) * std)
    return policy.replace(params=jax.tree.unflatten(treedef, drawn))


def export(case: str, out: str) -> str:
    fixture, targets = CASES[case]
    source = os.path.join(HERE, "transformers5", fixture)
    spec = lora.LoraSpec(RANK, ALPHA, tuple(targets))
    base = models.from_pretrained(source, dtype="float32", progress=False)
    policy = randomized(lora.add_adapters(base, spec, seed=0), seed=1)
    directory = os.path.join(out, case)
    lora_export.save_peft(policy, spec, os.path.join(directory, "adapter"), base_model_name_or_path=source)
    lora_export.save_merged(policy, spec, os.path.join(directory, "hf"), base=source)
    reference = np.load(os.path.join(source, "expected.npz"))
    valid = reference["attention_mask"].astype(bool)
    logits = models.forward(policy, jnp.asarray(reference["tokens"], jnp.int32), jnp.asarray(valid))
    np.savez(os.path.join(directory, "expected.npz"), tokens=reference["tokens"],
             attention_mask=reference["attention_mask"], position_ids=reference["position_ids"],
             logits=np.asarray(logits, np.float32))
    return (f"python tests/data/hf/check_peft_load.py --base {source} --adapter {directory}/adapter "
            f"--merged {directory}/hf --expected {directory}/expected.npz")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the exports (created)")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    for case in args.cases:
        print(export(case, os.path.abspath(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
