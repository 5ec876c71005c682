"""Peak host memory of `models.from_pretrained` on a ~1 GB synthetic Hugging Face checkpoint.

    python benchmarks/load_memory.py [--dir /tmp/jaxrl-load-bench] [--keep]

Writes a Llama-shaped bf16 checkpoint (random weights, two safetensors shards + index) once, then loads
it in fresh subprocesses (so each peak is that load's alone) and reports, from `ru_maxrss`:
  overhead = peak RSS - RSS before loading (jax initialised) - bytes of the loaded parameters,
compared with the largest single tensor. The goal: overhead <= one tensor. Prints JSON, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

CONFIG = {  # ~0.51 B parameters: 1.02 GB in bf16
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 5632, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def write_checkpoint(directory: str) -> None:
    import ml_dtypes
    import numpy as np

    from jaxrl import models
    from jaxrl.models.hf import _param_paths, _shard, hf_name
    from jaxrl.models.hf_config import from_hf
    from jaxrl.models.safetensors_io import TensorSpec, write_file

    policy = models.abstract(from_hf(CONFIG))

    specs = [TensorSpec(hf_name(p), np.dtype(ml_dtypes.bfloat16), tuple(v.shape))
             for p, v in _param_paths(policy.params)]
    rng = np.random.default_rng(0)
    shards = _shard(specs, 600 * 2**20)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    os.makedirs(directory, exist_ok=True)
    for name, shard in zip(names, shards):
        arrays = ((rng.standard_normal(s.shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16) for s in shard)
        write_file(os.path.join(directory, name), shard, arrays, {"format": "pt"})
    index = {"metadata": {}, "weight_map": {s.name: n for n, shard in zip(names, shards) for s in shard}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)


def measure(directory: str, dtype: str) -> dict:
    """Run in a fresh process: load once, report RSS figures in bytes."""
    import jax
    import jax.numpy as jnp

    from jaxrl import models
    jnp.ones(8).block_until_ready()  # backend initialised before the baseline
    baseline = _rss_now()
    start = time.perf_counter()
    policy = models.from_pretrained(directory, dtype, progress=False)
    jax.block_until_ready(policy.params)
    seconds = time.perf_counter() - start
    leaves = jax.tree.leaves(policy.params)
    param_bytes = sum(x.nbytes for x in leaves)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"dtype": dtype, "baseline_rss": baseline, "peak_rss": peak, "final_rss": _rss_now(),
            "param_bytes": param_bytes, "largest_tensor_bytes": max(x.nbytes for x in leaves),
            "largest_stored_tensor_bytes": max(x.size for x in leaves) * 2,
            "overhead_bytes": peak - baseline - param_bytes, "load_seconds": seconds}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/jaxrl-load-bench")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint for the next run")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: the subprocess
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.dir, args.measure)))
        return
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        write_checkpoint(args.dir)
    results = []
    for dtype in ("bfloat16", "float32"):
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        out = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--measure", dtype], env=env,
                             capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
    print(json.dumps({"checkpoint_bytes": checkpoint_bytes, "results": results}, indent=2))
    mb = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    print(f"\ncheckpoint: {mb(checkpoint_bytes)} on disk (bf16, 2 shards)\n")
    print("| load dtype | parameters | largest tensor stored / loaded | RSS before | peak RSS | overhead "
          "(peak - before - parameters) | load time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['dtype']} | {mb(r['param_bytes'])} | {mb(r['largest_stored_tensor_bytes'])} / "
              f"{mb(r['largest_tensor_bytes'])} | {mb(r['baseline_rss'])} | {mb(r['peak_rss'])} | "
              f"{mb(r['overhead_bytes'])} | {r['load_seconds']:.1f} s |")
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
