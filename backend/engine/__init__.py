"""The training engine: the trainer's loop, the Ray worker group and its ranks (actor, reference,
rollout, critic, reward model), FSDP2 sharding, the log-prob pass, evaluation and the pre-run checks."""
