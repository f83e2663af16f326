"""The toy environment of examples/rl_tiny: one turn, reward = the fraction of the response's
words that are the prompt's target word (0 for an empty response)."""

from typing import Any, Dict

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class WordsEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Dict[str, Any] = {}):
        super().__init__()
        if "target" not in extras:
            raise ValueError("rl_tiny_words needs a 'target' word in each dataset row")
        self.target = extras["target"]

    def step(self, action: str) -> BaseTextEnvStepOutput:
        words = action.split()
        reward = sum(w == self.target for w in words) / len(words) if words else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})
