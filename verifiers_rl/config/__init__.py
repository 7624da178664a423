"""The configuration: RLConfig (rl_config.py), what each of TRL's GRPOConfig fields does here (grpo_fields.py).

``from verifiers_rl import RLConfig`` is the public name; this package imports nothing itself, so
``python -m verifiers_rl.config.grpo_fields`` runs its module once.
"""
