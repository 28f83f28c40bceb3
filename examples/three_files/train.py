"""Train with your own reward: `python train.py [key.path=value ...]`."""

import sys

import reward_fn  # noqa: F401  (registers the scorer for data_source "arithmetic")

import backend

config = backend.load_config("config.yaml", sys.argv[1:])
trainer = backend.Trainer(config)
trainer.train()

print("validation:", trainer.evaluate())
print("answer:", trainer.generate("Tom has 3 apples and buys 4 more. How many apples does he have?")[0][0])
print("exported to", trainer.export())
