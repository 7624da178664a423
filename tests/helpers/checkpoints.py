"""A crafted checkpoint for the tests that a resume refuses it: code planted in a torch file, the manifest matching."""

from __future__ import annotations

from pathlib import Path

import torch

from verifiers_rl.training.run_state import verify_manifest, write_manifest


class PlantedCode:
    """Unpickled, it creates ``marker``: the proof that a load ran code from the file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(file: Path, checkpoint: Path, marker: Path) -> None:
    """Add a ``PlantedCode`` entry to the (trusted, our own) torch file ``file`` of ``checkpoint`` and rewrite the
    checkpoint's manifest to match, so nothing but the file's contents can give it away."""
    state = torch.load(file, weights_only=False)
    state["planted"] = PlantedCode(marker)
    torch.save(state, file)
    write_manifest(checkpoint)
    assert verify_manifest(checkpoint) is None  # the manifest does not give it away
