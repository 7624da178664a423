"""A verifiers 0.4 environment with a sub-agent: the ``lead`` seat reverses a word after its ``scout`` sub-agent
has given it a hint. Both seats are trainable agents, so an episode has two trainable branches (a trace each);
the episode's outcome (rewards with weights) is recorded on both traces, as an environment that trains its
sub-agents on the episode's result does. Unchanged verifiers 0.4 code: nothing here knows verifiers_rl
(tests/v1/test_v1_subagent.py recomputes the rewards with ``score``)."""

import verifiers.v1 as vf

WORDS = ["hello", "world", "stone", "river", "plant", "cloud"]
WEIGHTS = {"solved": 1.0, "brief": 0.5}


def score(reply: str, answer: str) -> dict[str, float]:
    """The lead's final reply against the reversed word: solved (exactly it) and brief (1 / (1 + its length))."""
    reply = reply.strip()
    return {"solved": float(reply == answer), "brief": 1.0 / (1 + len(reply))}


class RelayData(vf.TaskData):
    answer: str = ""
    word: str = ""


class RelayTask(vf.Task[RelayData]):
    pass


class RelayConfig(vf.TasksetConfig):
    num_tasks: int = 6


class RelayEnvConfig(vf.EnvConfig):
    lead: vf.AgentConfig = vf.AgentConfig()
    scout: vf.AgentConfig = vf.AgentConfig()


class RelayEnv(vf.Env[RelayEnvConfig]):
    async def run(self, task, agents):
        word, answer = task.data.word, task.data.answer
        scout = await agents.scout.run(
            RelayTask(RelayData(prompt=f"Give a one-line hint for reversing the word {word}.", word=word,
                                answer=answer), task.config))
        lead = await agents.lead.run(
            RelayTask(RelayData(prompt=f"{task.data.prompt}\nYour scout's hint: {scout.last_reply or ''}", word=word,
                                answer=answer), task.config))
        for trace in (scout, lead):  # the sub-agent trains on the episode's outcome, as the lead does
            for name, value in score(lead.last_reply or "", answer).items():
                trace.record_reward(name, value, WEIGHTS[name])


class RelayTaskset(vf.Taskset[RelayTask, RelayConfig]):
    def load(self) -> list[RelayTask]:
        return [
            RelayTask(RelayData(prompt=f"Reverse the text: {w}", word=w, answer=w[::-1]), self.config.task)
            for w in (WORDS * 10)[: self.config.num_tasks]
        ]


__all__ = ["RelayTaskset", "RelayEnv"]
