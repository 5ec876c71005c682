#!/usr/bin/env bash
# A new user's trial: a tiny HF checkpoint, a GSM8K-style JSONL, a reward and a loss of their own, from YAML only.
# Usage: benchmarks/user_trial.sh [CHECKOUT]   (uses CHECKOUT/.venv, default: this checkout; `make install-dev`
# first). Works in /tmp/trial; prints each step's output and time.
set -u
REPO=$(cd "${1:-$(dirname "$0")/..}" && pwd)
export PATH=$REPO/.venv/bin:$PATH JAX_PLATFORMS=cpu WANDB_MODE=offline WANDB_SILENT=true
T=/tmp/trial; rm -rf $T; mkdir -p $T; cd $T
step() { echo; echo "=== $*"; }
step "jaxrl tiny-checkpoint"; time jaxrl tiny-checkpoint tiny --family qwen2 2>&1 | tail -2
python - <<'PY'
import json, random
rng = random.Random(0)
def row(a, b):
    return {"question": f"What is {a}+{b}?", "answer": f"{a}+{b}={a+b} #### {a+b}", "level": "easy"}
with open("train.jsonl", "w") as f:
    for _ in range(64): f.write(json.dumps(row(rng.randint(1, 9), rng.randint(1, 9))) + "\n")
with open("test.jsonl", "w") as f:
    for _ in range(16): f.write(json.dumps(row(rng.randint(1, 9), rng.randint(1, 9))) + "\n")
with open("chat.jsonl", "w") as f:
    for _ in range(32):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        f.write(json.dumps({"messages": [{"role": "system", "content": "Answer after ####."},
                                         {"role": "user", "content": f"What is {a}+{b}?"},
                                         {"role": "assistant", "content": f"{a}+{b}={a+b} #### {a+b}"}]}) + "\n")
PY
cat > my_rewards.py <<'PY'
import re
from jaxrl.rewards import math_verify

def step_credit(prompt, completion, reference, row):
    """The right final answer (sympy-checked), plus 0.1 per right `a+b=c` step (easy rows only)."""
    final = reference.rpartition("####")[2].strip()
    steps = re.findall(r"(\d+)\+(\d+)=(\d+)", completion)
    right = sum(int(a) + int(b) == int(c) for a, b, c in steps)
    return math_verify(completion, final) + 0.1 * min(right, 3) * (row["level"] == "easy")
PY
cat > my_losses.py <<'PY'
import jax.numpy as jnp
from jaxrl import registry

@registry.register("objective", "soft_clip")
def soft_clip(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c):
    ratio = jnp.exp(log_ratio)
    return -(1.0 + eps_high * jnp.tanh((ratio - 1.0) / eps_high)) * advantages, {}

@registry.register("advantage", "rank")
def rank(inputs, config):
    groups = inputs.rewards.reshape(-1, inputs.group_size)
    ranks = jnp.argsort(jnp.argsort(groups, axis=1), axis=1).astype(jnp.float32)
    return (ranks / (inputs.group_size - 1) - 0.5).reshape(-1)
PY
cat > recipe.yaml <<'PY'
imports: [my_losses]
output_dir: runs/mine
pretrained: {path: tiny}
data: {train_file: train.jsonl, eval_file: test.jsonl, solution_field: answer, reference_field: answer,
       reference_pattern: '#### (.+)$', chat_template: true, template: "{question} (level: {level})"}
reward: {function: my_rewards:step_credit, num_workers: 1}
eval: {reward: math, batch_size: 16, every: 0}
sft: {steps: 10, batch_size: 8}
rl: {steps: 3, prompts_per_step: 4, group_size: 4, sampling: {max_new_tokens: 16},
     loss: {objective: soft_clip, advantage: {estimator: rank}}}
checkpoint: {every: 1}
log: {samples_every: 1, samples_per_step: 2}
wandb: true
PY
step "--print-config (head)"; jaxrl train recipe.yaml --print-config | sed -n '1,12p'
step "--dry-run"; time jaxrl train recipe.yaml --dry-run; echo "rc=$?"; ls
step "wrong signature"; sed 's/def step_credit(prompt, completion, reference, row)/def step_credit(text, answer)/' my_rewards.py > bad_rewards.py
jaxrl train recipe.yaml reward.function=bad_rewards:step_credit; echo "rc=$?"
step "train"; time jaxrl train recipe.yaml 2>&1 | tail -14; echo "rc=${PIPESTATUS[0]}"
ls runs/mine; head -c 600 runs/mine/samples.jsonl; echo; grep -A4 piece_sources runs/mine/config.yaml
step "eval RUN"; time jaxrl eval runs/mine --completions completions.jsonl 2>&1 | tail -12; echo "rc=${PIPESTATUS[0]}"; wc -l completions.jsonl
step "convert without --base"; jaxrl convert runs/mine hf_out 2>&1 | tail -3; echo "rc=${PIPESTATUS[0]}"; ls hf_out
step "resume from config.yaml"; time jaxrl train runs/mine/config.yaml resume=true rl.steps=4 2>&1 | tail -6
echo "rc=${PIPESTATUS[0]}"
step "changed source refused"; echo "# edited" >> my_rewards.py
jaxrl train runs/mine/config.yaml resume=true rl.steps=5 2>&1 | tail -2; echo "rc=${PIPESTATUS[0]}"
step "chat messages: warm start then RL on the same file"
time jaxrl train recipe.yaml data.format=messages data.train_file=chat.jsonl data.eval_file=chat.jsonl \
  data.solution_field=null "data.template='{prompt}'" "data.reference_pattern='#### (.+)\$'" reward.function=math \
  eval.reward=null wandb=false output_dir=runs/chat 2>&1 | tail -12; echo "rc=${PIPESTATUS[0]}"
grep -c '"phase": "sft"' runs/chat/metrics.jsonl
step "tensorboard without tensorboardX"; python -c "import tensorboardX" 2>/dev/null && echo "(tensorboardX is installed: skipped)" || { jaxrl train recipe.yaml tensorboard=true output_dir=runs/tb; echo "rc=$?"; ls runs; }
