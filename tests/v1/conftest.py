"""What every verifiers 0.4 (v1) test shares: they need the venv scripts/install_verifiers_v1.sh makes (the README's
set-up installs it; without it they are skipped, saying so), and the tiny model's embedded engine."""

import pytest

from verifiers_rl.envs.adapters.verifiers_v1 import v1_python
from verifiers_rl.inference import EmbeddedEngine, SamplingConfig


def pytest_collection_modifyitems(items):
    if v1_python().exists():
        return
    skip = pytest.mark.skip(reason="no verifiers 0.4 venv: run scripts/install_verifiers_v1.sh")
    for item in items:
        if "tests/v1/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = EmbeddedEngine(tiny_model_dir, sampling=SamplingConfig(temperature=1.0, max_new_tokens=10))
    yield engine
    engine.close()
