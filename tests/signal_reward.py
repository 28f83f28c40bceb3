"""A reward whose scores differ within a group even on a random model's output, for the tests that compare
training across ranks or micro-batchings. With every score equal (a random model answers nothing right) the
advantages are 0 and the gradient is float rounding, which Adam scales into steps as large as the learning
rate: such a run follows the rounding of its summation order, not the gradient a test means to compare."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3) / 2
