"""Model folders laid out as a Hub repository may be: the model in a subfolder beside another tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

OTHER_TEMPLATE = "OTHER {{ messages }}"


def a_model_in_a_subfolder(tiny_model_dir: str, root: Path) -> Path:
    """``root/sub`` the tiny model; ``root`` itself only another tokenizer (its own chat template), no model."""
    shutil.copytree(tiny_model_dir, root / "sub")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "sub" / name, root / name)
    (root / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    return root
