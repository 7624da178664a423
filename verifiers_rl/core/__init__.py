"""What every part shares: the rollout record, the engine and sampler protocols, the choices, model loading and the process set-up; imports nothing else of verifiers_rl but compat."""
