"""Rollout engines: prompts in, n sampled responses per prompt out, behind one interface (the static-cache
engine of our own, Hugging Face generate, vLLM)."""
