"""A GSM8K-style scorer: the number after '####' must equal the ground truth."""

import re

import backend


@backend.register_reward("arithmetic")
def hash_answer_score(data_source, solution_str, ground_truth, extra_info=None):
    match = re.search(r"####\s*(-?[\d,]+(?:\.\d+)?)", solution_str)
    if match is None:
        return -0.5
    return 1.0 if float(match.group(1).replace(",", "")) == float(ground_truth) else -0.5
