"""core.paths: whether a path a run writes can be created, probed by every rank of a launch at once."""

from __future__ import annotations

import multiprocessing
import os

from verifiers_rl.core.paths import unwritable


def _probe_all(base: str) -> list[str]:
    return [why for j in range(200) if (why := unwritable(os.path.join(base, f"run{j}", "out"), is_file=False))]


def test_ranks_probing_the_same_new_folders_at_once_all_find_them_writable(tmp_path):
    """Each probe makes the folder and removes what it made: a rank's clean-up removed a folder another had just made
    (its temporary file then failed with FileNotFoundError, or its mkdir with FileExistsError), and a writable
    --output_dir was refused on that rank (about 5 of 800 probes here, four processes)."""
    with multiprocessing.get_context("fork").Pool(4) as pool:
        refusals = [why for whys in pool.map(_probe_all, [str(tmp_path)] * 4) for why in whys]
    assert refusals == []  # (a folder two ranks made at once may stay behind, empty: the run makes it anyway)


def test_a_path_that_cannot_be_made_is_still_refused():
    assert "cannot create or write the folder" in unwritable("/proc/verifiers_rl_probe/out", is_file=False)
