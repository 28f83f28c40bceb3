"""The benchmark's reward: the share of distinct words in a response. Cheap, and it differs between the
samples of a prompt, so advantages are not all zero; its value does not matter for timing."""


def distinct_words(data_source, solution_str, ground_truth, extra_info=None) -> float:
    words = solution_str.split()
    return len(set(words)) / max(len(words), 1)
