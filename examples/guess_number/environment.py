"""A guessing game as a multi-turn environment: the model guesses a number, the environment answers
"higher" or "lower", and a right guess within the turns scores 1 (less 0.1 for each wrong guess before it)."""

from backend import Environment, Step, register_environment


@register_environment("guess_number")
class Guess(Environment):
    def reset(self, row):
        self.target = int(row["ground_truth"])
        self.wrong = 0
        return row["messages"]

    def step(self, assistant_text):
        digits = "".join(ch if ch.isdigit() else " " for ch in assistant_text).split()
        if not digits:
            return Step(observation=[{"role": "user", "content": "Answer with a number."}])
        guess = int(digits[-1])
        if guess == self.target:
            return Step(reward={"solved": max(1.0 - 0.1 * self.wrong, 0.0)}, done=True)
        self.wrong += 1
        return Step(observation=[{"role": "user", "content": "Higher." if guess < self.target else "Lower."}])
