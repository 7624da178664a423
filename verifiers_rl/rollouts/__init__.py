"""Where the trainer's batches come from: live generation, replay, evaluation's rollouts."""
