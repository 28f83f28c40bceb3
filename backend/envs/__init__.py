"""Environments and tools for multi-turn episodes: what the model calls and what answers it."""
