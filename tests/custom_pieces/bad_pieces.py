"""Pieces with the wrong signatures: a config naming them is refused when it loads."""


def reward_of_two(text, answer):
    return 1.0


def objective_of_three(log_ratio, advantages, logp):
    return -log_ratio * advantages, {}


def advantage_of_rewards(rewards, group_size):
    return rewards
