"""The RL math: advantages, losses, KL, masked statistics. Pure torch functions on (batch,
response_len) tensors that import nothing else of this project."""
