"""Triton kernels for GPUs (decode attention, the vocabulary pass), each behind a function that says
whether it can run and a PyTorch reference the tests hold it against."""
