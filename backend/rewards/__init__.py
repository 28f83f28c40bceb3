"""Rewards: the registry of scorers keyed by `data_source`, the built-in rules, and batch scoring that
no scorer's failure or hang can stop. No model code lives here (the reward model is a worker of the
engine)."""

from backend.rewards import rules  # noqa: F401  (registers the built-in scorers)
