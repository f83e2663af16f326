"""The toy environment of examples/rl_tiny, registered with skyrl_gym as ``rl_tiny_words`` when
this module is imported (``trainer.kda.env_modules=[examples.rl_tiny.words_env]``): one turn;
the reward is the fraction of the response's words that are real words of the tokenizer (not its
``w<i>`` fillers), 0 for an empty response. A random model says a real word about one time in
ten, so rewards differ between the samples of a prompt (GRPO needs that) and a policy that learns
the words gets more."""

import re
from typing import Any, Dict

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

ENV = "rl_tiny_words"
FILLER = re.compile(r"w\d+")


class WordsEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Dict[str, Any] = {}):
        super().__init__()

    def step(self, action: str) -> BaseTextEnvStepOutput:
        words = action.split()
        reward = sum(not FILLER.fullmatch(w) for w in words) / len(words) if words else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


if ENV not in skyrl_gym.envs.registration.registry:
    skyrl_gym.register(id=ENV, entry_point=f"{__name__}:WordsEnv")
