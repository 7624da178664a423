"""A difficulty curriculum (``--curriculum_*``; a mixture entry's ``curriculum:``): prime-rl's difficulty buffer, or
online difficulty filtering. Each prompt's recent pass rate is tracked; a prompt that is too easy or too hard is set
aside for some epochs of its environment's rows, or for good, and the draws skip it.

Draws: each environment (a mixture's entry, or the one environment) has a cursor into its rows' order, epoch after
epoch (the same seeded shuffles as without a curriculum, so nothing set aside draws the same rows); the next row of an
entry is the first one at or after its cursor that is not set aside in the epoch it falls in. The entry of a position
is drawn by weight from the position's seed, as without a curriculum. So a batch's rows are a function of the seed,
the position and this state, which a checkpoint keeps (``to_json``): a resumed run draws what the saved run drew.

An entry whose every row is set aside in its current epoch draws them anyway, in order (a warning says so): a run
never stops or stalls for it, and the rows come back as their epochs pass (``curriculum/set_aside`` shows it).
"""

from __future__ import annotations

import copy
import logging
import statistics
from collections.abc import Sequence
from dataclasses import fields

from verifiers_rl.core.curriculum import CurriculumSettings
from verifiers_rl.core.rollout import Rollout, group_episodes
from verifiers_rl.core.sampling import epoch_order, refill_sample

logger = logging.getLogger(__name__)

STATE_FORMAT = 1
EASY, HARD = "easy", "hard"


class Curriculum:
    """The tracked state of one run's curriculum over ``environment``'s training ``rows`` (a ``MixtureEnv``: one
    ``settings`` per entry; else one). State: each entry's draw cursor, each row's last pass fractions (at most
    ``window``) and the rows set aside (until which epoch of their entry, None for good, and why)."""

    def __init__(self, environment, rows: Sequence, settings: list[CurriculumSettings], seed: int,
                 shuffle: bool = True):
        self.environment = environment
        self.mixture = hasattr(environment, "entry_order")
        self.names = [entry.name for entry in environment.entries] if self.mixture else [None]
        if len(settings) != len(self.names):
            raise ValueError(f"Curriculum: {len(settings)} settings for {len(self.names)} environment(s).")
        self.settings = settings
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self._index = {id(row): i for i, row in enumerate(rows)}
        self._sizes = [len(environment.entry_rows(e)) for e in range(len(self.names))] if self.mixture else [len(rows)]
        self._orders: dict[tuple[int, int], list[int]] = {}
        self._warned: set[int] = set()
        self.cursors = [0] * len(self.names)
        self.history: dict[int, list[float]] = {}
        self.set_aside: dict[int, tuple[int | None, str]] = {}
        self._drawn_in: dict[int, int] = {}  # row -> the epoch of its latest draw in this batch (for ``record``)

    # --- draws -----------------------------------------------------------------------------------------------------

    def entry_of(self, row: int) -> int:
        return self.rows[row].entry if self.mixture else 0

    def epoch(self, entry: int) -> int:
        """The epoch of ``entry``'s rows its next draw falls in."""
        return self.cursors[entry] // self._sizes[entry]

    def order(self, entry: int, epoch: int) -> list[int]:
        """``entry``'s rows in epoch ``epoch``: the draw order the run has without a curriculum."""
        key = (entry, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self._sizes):
                self._orders.clear()  # orders are recomputed at will: a cache, not state
            if self.mixture:
                self._orders[key] = self.environment.entry_order(entry, epoch, self.seed, self.shuffle)
            else:  # the generator's own order without a curriculum
                self._orders[key] = epoch_order(self._sizes[0], epoch, self.seed, self.shuffle)
        return self._orders[key]

    def aside(self, row: int, epoch: int) -> bool:
        """Whether ``row`` is set aside in epoch ``epoch`` of its entry."""
        held = self.set_aside.get(row)
        return held is not None and (held[0] is None or epoch < held[0])

    def _all_aside(self, entry: int, epoch: int) -> bool:
        if len(self.set_aside) < self._sizes[entry]:
            return False  # the usual case, without a pass over the rows set aside
        count = sum(1 for row in self.set_aside if self.entry_of(row) == entry and self.aside(row, epoch))
        return count >= self._sizes[entry]

    def draw(self, positions: list[int]) -> list[tuple[int, int]]:
        """(position, row) for each of ``positions`` (in order): the entry by weight (a mixture) or the one
        environment, then that entry's next row not set aside. Advances the cursors."""
        picked = []
        for position in positions:
            entry = self.environment.entry_at(position, self.seed) if self.mixture else 0
            picked.append((position, self._next_row(entry)))
        return picked

    def _next_row(self, entry: int) -> int:
        size = self._sizes[entry]
        if self._all_aside(entry, self.epoch(entry)):
            if entry not in self._warned:
                self._warned.add(entry)
                logger.warning("Curriculum: every row of %s is set aside; drawing them anyway until some come back.",
                               self.names[entry] or "the environment")
            epoch, offset = divmod(self.cursors[entry], size)
            self.cursors[entry] += 1
            return self._drawn(self.order(entry, epoch)[offset], epoch)
        # Some row is drawable in this epoch, and a later epoch sets none aside that this one does not: within two
        # epochs one is found.
        for _ in range(2 * size):
            epoch, offset = divmod(self.cursors[entry], size)
            self.cursors[entry] += 1
            row = self.order(entry, epoch)[offset]
            if not self.aside(row, epoch):
                return self._drawn(row, epoch)
        raise AssertionError("Curriculum: no drawable row within two epochs.")  # unreachable (see above)

    def _drawn(self, row: int, epoch: int) -> int:
        self._drawn_in[row] = epoch
        return row

    def refill(self, index: int, round_: int, count: int) -> list[int]:
        """Dynamic sampling's refill rows of batch ``index``, round ``round_``, from the rows not set aside (all of
        an entry's when every one is): as the draws without a curriculum (``MixtureEnv.draw_refill``, or a seeded
        sample), which they equal while nothing is set aside."""
        if not self.mixture:
            rows = refill_sample(self._drawable(0), count, self.seed, index, round_)
        else:
            rows = self.environment.draw_refill(index, round_, count, self.seed, rows_of=self._drawable)
        return [self._drawn(row, self.epoch(self.entry_of(row))) for row in rows]

    def _drawable(self, entry: int) -> list[int]:
        epoch = self.epoch(entry)
        every = self.environment.entry_rows(entry) if self.mixture else range(self._sizes[0])
        return [row for row in every if not self.aside(row, epoch)] or list(every)

    # --- pass rates ---------------------------------------------------------------------------------------------------

    def record_group(self, row, group: list[Rollout]) -> None:
        """A generated group of ``row`` (a row object of ``rows``): its pass fraction (over episodes, each with its
        first branch's reward, as evaluation counts them) joins the row's history, and a full window whose mean
        crosses a threshold sets the row aside (its history starts again)."""
        self.record(self._index[id(row)], [episode[0].reward for episode in group_episodes(group)])

    def record(self, row: int, rewards: list[float]) -> None:
        entry = self.entry_of(row)
        settings = self.settings[entry]
        if not settings.active or not rewards:
            return
        passed = sum(1 for reward in rewards if reward >= settings.pass_reward) / len(rewards)
        history = self.history.setdefault(row, [])
        history.append(passed)
        del history[:-settings.window]
        if len(history) < settings.window:
            return
        rate = statistics.fmean(history)
        kind = (EASY if settings.easy_above is not None and rate >= settings.easy_above else
                HARD if settings.hard_below is not None and rate <= settings.hard_below else None)
        if kind is not None:
            epochs = settings.set_aside_epochs
            drawn_in = self._drawn_in.get(row, self.epoch(entry))  # the epoch its group was drawn in
            self.set_aside[row] = (None if epochs == 0 else drawn_in + epochs + 1, kind)
            del self.history[row]

    def metrics(self) -> dict[str, float]:
        """``curriculum/set_aside`` (rows set aside now), ``curriculum/set_aside_easy`` and ``_hard``; a mixture's
        also per entry, ``env/<name>/curriculum/...``. Rows whose epochs are over are dropped from the state here."""
        for row in [row for row in self.set_aside if not self.aside(row, self.epoch(self.entry_of(row)))]:
            del self.set_aside[row]
        counts = {(entry, kind): 0 for entry in range(len(self.names)) for kind in (EASY, HARD)}
        for row, (_, kind) in self.set_aside.items():
            counts[self.entry_of(row), kind] += 1
        out = {}
        for prefix, entries in [("", range(len(self.names)))] + (
                [(f"env/{name}/", [e]) for e, name in enumerate(self.names)] if self.mixture else []):
            easy = float(sum(counts[e, EASY] for e in entries))
            hard = float(sum(counts[e, HARD] for e in entries))
            out.update({f"{prefix}curriculum/set_aside": easy + hard, f"{prefix}curriculum/set_aside_easy": easy,
                        f"{prefix}curriculum/set_aside_hard": hard})
        return out

    # --- checkpoints --------------------------------------------------------------------------------------------------

    def copy(self) -> "Curriculum":
        """A copy whose state changes leave this one's as it is (a batch's draft, kept once the batch is done)."""
        twin = copy.copy(self)
        twin.cursors = list(self.cursors)
        twin.history = {row: list(passes) for row, passes in self.history.items()}
        twin.set_aside = dict(self.set_aside)
        twin._drawn_in = {}  # a batch records only what it drew
        return twin

    def to_json(self) -> dict:
        """The state as JSON data (a checkpoint's ``curriculum.json``)."""
        return {"format": STATE_FORMAT, "environments": self.names, "rows": self._sizes, "cursors": self.cursors,
                "history": {str(row): passes for row, passes in sorted(self.history.items())},
                "set_aside": {str(row): [until, kind] for row, (until, kind) in sorted(self.set_aside.items())}}

    def load_json(self, state: dict, where: str) -> None:
        """Continue from ``to_json``'s ``state``; ValueError naming ``where`` when it is not this run's."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"{where}: curriculum state format {state.get('format')!r}, expected {STATE_FORMAT}.")
        if state["environments"] != self.names or state["rows"] != self._sizes:
            raise ValueError(f"{where}: the curriculum tracked environments {state['environments']} of "
                             f"{state['rows']} rows, this run has {self.names} of {self._sizes} (--env).")
        self.cursors = [int(cursor) for cursor in state["cursors"]]
        self.history = {int(row): [float(p) for p in passes] for row, passes in state["history"].items()}
        self.set_aside = {int(row): (until, kind) for row, (until, kind) in state["set_aside"].items()}


def build_curriculum(args, environment, rows: Sequence) -> Curriculum | None:
    """The curriculum ``args`` (an ``RLConfig``: ``--curriculum_*``) and a mixture's entries (their ``curriculum:``)
    ask for over ``environment``'s ``rows``, or None when no threshold is set. Raises ValueError naming the entry whose
    settings cannot work, or an environment that orders its own rows otherwise than a mixture."""
    from verifiers_rl.core.settings import settings_from, source_of

    base = settings_from(args, CurriculumSettings)
    if hasattr(environment, "entry_order"):
        settings = [base.overridden(entry.curriculum, f"--env entry {entry.name!r}: ") if entry.curriculum else base
                    for entry in environment.entries]
        for entry, entry_settings in zip(environment.entries, settings):
            if entry.curriculum and not entry_settings.active:
                raise ValueError(f"--env entry {entry.name!r}: curriculum: {entry.curriculum} tunes a curriculum, "
                                 "which acts only with easy_above or hard_below (the entry's own, or "
                                 "--curriculum_easy_above / --curriculum_hard_below); neither is set for it, so it "
                                 "would change nothing.")
    else:
        settings = [base]
    if not any(s.active for s in settings):
        # The window, pass reward and epochs tune a curriculum: with no threshold anywhere they would change nothing.
        default = CurriculumSettings()
        tuned = [f"--{source_of(f)} {getattr(base, f.name)}" for f in fields(CurriculumSettings)
                 if getattr(base, f.name) != getattr(default, f.name)]
        if tuned:
            raise ValueError(f"{', '.join(tuned)} tunes the curriculum, which acts only with --curriculum_easy_above "
                             "or --curriculum_hard_below (or a mixture entry's curriculum: thresholds); none is set, "
                             "so it would change nothing. Set a threshold, or leave it out.")
        return None
    if getattr(environment, "draw_rows", None) is not None and not hasattr(environment, "entry_order"):
        raise ValueError(f"--curriculum_easy_above / --curriculum_hard_below: {environment.name} orders its own rows "
                         "(draw_rows), which the curriculum cannot steer.")
    return Curriculum(environment, rows, settings, args.seed, args.shuffle_dataset)
