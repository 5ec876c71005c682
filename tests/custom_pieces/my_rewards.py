"""A reward of a user's own (the issue's acceptance example): credit for each right step of a chain."""
import re


def step_credit(prompt, completion, reference, row):
    """1 for the right answer after `####`, plus 0.1 for each `a+b=c` step whose sum is right (at most 3)."""
    final = completion.rpartition("####")[2].strip()
    correct = float(bool(completion.count("####")) and final == str(reference).strip())
    steps = re.findall(r"(-?\d+)([+-])(\d+)=(-?\d+)", completion)
    right = sum(int(a) + (int(b) if op == "+" else -int(b)) == int(c) for a, op, b, c in steps)
    return correct + 0.1 * min(right, 3) * (row["prompt"] == prompt)
