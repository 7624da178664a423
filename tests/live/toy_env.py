"""A toy environment a random tiny model can learn in seconds: reward = fraction of vowels in the completion text."""

from verifiers_rl.envs import Rubric, SingleTurnEnv


def vowel_fraction(completion) -> float:
    text = "".join(message["content"] for message in completion if message["role"] == "assistant")
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def load_environment(tokenizer, num_examples: int = 8, max_new_tokens: int = 8, fail_reward: bool = False, **_):
    funcs = [vowel_fraction]
    if fail_reward:
        def broken_reward(completion):
            raise RuntimeError("the reward server is down")

        funcs.append(broken_reward)
    dataset = [{"question": f"Say something with vowels, please ({i})."} for i in range(num_examples)]
    return SingleTurnEnv(dataset, Rubric(funcs), tokenizer, max_new_tokens=max_new_tokens, max_seq_len=64, name="toy_vowels")


class FailingEnv(SingleTurnEnv):
    """Raises in the middle of its rollouts after ``fail_after`` successful model turns."""

    def __init__(self, *args, fail_after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_after = fail_after
        self.turns = 0

    async def generate(self, sampler, prompt, prompt_ids, state):
        self.turns += 1
        if self.turns > self.fail_after:
            raise ConnectionError("the game server went away")
        return await super().generate(sampler, prompt, prompt_ids, state)


def load_failing_environment(tokenizer, fail_after: int = 40, **_):
    dataset = [{"question": f"Say something ({i})."} for i in range(8)]
    return FailingEnv(dataset, Rubric([vowel_fraction]), tokenizer, max_new_tokens=8, max_seq_len=64,
                      name="failing_env", fail_after=fail_after)
