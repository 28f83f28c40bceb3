"""The multi-turn benchmark's environment: answers every turn with the same short user message, so an episode's
length is set by the turn limits and rollout.multi_turn.max_tokens_per_turn alone."""

from backend import Environment, Step

REPLY = [{"role": "user", "content": "Go on."}]


class FixedReply(Environment):
    def step(self, assistant_text):
        return Step(observation=REPLY)
