"""A three-turn guessing game as a verifiers 0.4 environment, in the shape of v1's bundled TextArena environments:
its own ``Env`` whose seat is named ``player`` (not ``agent``), the game playing the user host-side. The model
guesses a number from 1 to 9 in free text; after each guess that misses, the game answers "Higher." or "Lower."
(or that it found no number), for at most three guesses. Several rewards with weights. Unchanged verifiers 0.4
code: nothing here knows verifiers_rl (tests/v1/test_v1_training.py recomputes the rewards with ``score``)."""

import re

import verifiers.v1 as vf

TURNS = 3
WEIGHTS = {"solved": 1.0, "closeness": 0.5, "answered": 0.25}


def secret_of(game: int) -> int:
    return 1 + (game * 4) % 9


def guess_of(reply: str) -> int | None:
    """The first digit 1-9 in a free-text reply, if any."""
    match = re.search(r"[1-9]", reply)
    return int(match.group()) if match else None


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "I found no number from 1 to 9 in your reply. Guess again."
    return "Higher." if guess < secret else "Lower."


def score(replies: list[str], secret: int) -> dict[str, float]:
    """Each reward's score for a game whose guesses were ``replies``: solved (the last guess is the secret),
    closeness (1 - the best guess's distance / 8, 0 without a guess) and answered (the share of replies that
    named a number)."""
    guesses = [guess_of(reply) for reply in replies]
    named = [g for g in guesses if g is not None]
    return {
        "solved": float(bool(guesses) and guesses[-1] == secret),
        "closeness": 1.0 - min(abs(g - secret) for g in named) / 8 if named else 0.0,
        "answered": len(named) / len(replies) if replies else 0.0,
    }


class GuessData(vf.TaskData):
    secret: int = 5


class GuessTask(vf.Task[GuessData]):
    pass


class GuessConfig(vf.TasksetConfig):
    num_tasks: int = 8


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret, replies = task.data.secret, []
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()  # the prompt opens the game: the model guesses first
            while not segment.terminated:
                replies.append(segment.last_reply)
                guess = guess_of(segment.last_reply)
                if guess == secret or len(replies) == TURNS:
                    break
                segment = await interaction.turn(feedback(guess, secret))
        trace = interaction.trace
        for name, value in score(replies, secret).items():
            trace.record_reward(name, value, WEIGHTS[name])
        trace.record_metric("guesses", len(replies))


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> list[GuessTask]:
        return [
            GuessTask(GuessData(prompt=f"Game {i}: I am thinking of a number from 1 to 9. Guess it.",
                                secret=secret_of(i)), self.config.task)
            for i in range(self.config.num_tasks)
        ]


__all__ = ["GuessTaskset", "GuessEnv"]
