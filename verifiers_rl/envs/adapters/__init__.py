"""Environments from other libraries: reasoning-gym tasks, and verifiers (Environments Hub) environments."""
