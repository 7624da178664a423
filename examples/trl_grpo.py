"""A script in the form of TRL's GRPO documentation, with only the import changed.

    python examples/trl_grpo.py                 # SmolLM2-135M-Instruct (offline), 10 steps on 2 CPU cores
    python examples/trl_grpo.py --model tiny    # the random 100k-parameter test model, seconds

The original begins ``from trl import GRPOConfig, GRPOTrainer``; everything below that line is TRL's API: a dataset
with a ``prompt`` column (here conversational; a plain string works too) and extra columns that reach the reward
functions by name, two reward functions (one returns None for rows it does not judge), ``reward_weights``.
"""

import argparse

from datasets import Dataset

from verifiers_rl import RLConfig as GRPOConfig, RLTrainer as GRPOTrainer  # was: from trl import ...
from verifiers_rl.core.models import resolve_model

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "house"]
dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": f"Write the word '{word}' backwards. Answer with the word only."}],
     "answer": word[::-1], "kind": "reverse" if i % 2 else "spell"}
    for i, word in enumerate(WORDS * 4)
])


def exact(completions, answer, **kwargs):
    """1 when the reply is the reversed word."""
    return [float(c[0]["content"].strip().lower() == a) for c, a in zip(completions, answer)]


def shares_letters(completions, answer, kind, **kwargs):
    """Partial credit on 'reverse' rows only (None elsewhere: this function does not judge them)."""
    out = []
    for c, a, k in zip(completions, answer, kind):
        text = c[0]["content"].strip().lower()
        out.append(sum(x == y for x, y in zip(text, a)) / len(a) if k == "reverse" else None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --max_step: refused
    parser.add_argument("--model", default="smollm2", help="smollm2 (default, offline), tiny, or a folder / hub id")
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--output_dir", default="trl_grpo_out")
    cli = parser.parse_args()
    training_args = GRPOConfig(output_dir=cli.output_dir, max_steps=cli.max_steps, learning_rate=2e-5,
                               per_device_train_batch_size=16, num_generations=4, max_completion_length=16,
                               reward_weights=[1.0, 0.5], logging_steps=1, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(
        model=resolve_model(cli.model),
        reward_funcs=[exact, shares_letters],
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()


if __name__ == "__main__":
    main()
