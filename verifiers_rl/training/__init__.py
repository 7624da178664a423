"""The trainer and what one optimizer step needs: batching, forward, loss, weight sync, checkpoints."""
