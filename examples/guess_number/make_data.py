"""Write the guessing game's data: `python examples/guess_number/make_data.py [OUT_DIR]` (default: next to
this file), then `python -m backend train examples/guess_number/config.yaml`."""

import random
import sys
from pathlib import Path

from backend.core.data import write_rows

PROMPT = ("I am thinking of a whole number from 1 to 20. Guess it: answer with one number, and I will say "
          "higher or lower.")


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"data_source": "guess_number", "prompt": [{"role": "user", "content": PROMPT}],
             "reward_model": {"style": "rule", "ground_truth": str(rng.randint(1, 20))}} for _ in range(n)]


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    write_rows(rows(256, seed=0), out / "guess_train.parquet")
    write_rows(rows(32, seed=1), out / "guess_val.parquet")
    print(f"wrote {out / 'guess_train.parquet'} and {out / 'guess_val.parquet'}")
