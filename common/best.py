"""Choosing checkpoints by their validation score: the best one (best.pt, every recipe), the K best
(``--keep-best``), and stopping when the score no longer improves (``--patience``).

    best = BestScore("val_acc")                   # or BestScore("val_loss", higher_is_better=False)
    if best.improved(val["acc"], step):
        checkpoints.save(step, "best.pt")
"""

import math
from typing import NamedTuple


class BestScore:
    """The best validation score so far and its step, the step whose weights best.pt holds."""

    def __init__(self, name: str, higher_is_better: bool = True):
        self.name, self.higher_is_better = name, higher_is_better
        self.score, self.step = math.nan, 0

    def improved(self, score: float, step: int) -> bool:
        """Whether ``score`` is the best so far (then it is kept as such)."""
        better = math.isnan(self.score) or (score > self.score if self.higher_is_better else score < self.score)
        if better:
            self.score, self.step = score, step
        return better

    def metrics(self) -> dict[str, float]:
        return {f"best_{self.name}": self.score, "best_step": self.step}

    def state_dict(self) -> dict:
        return {"score": self.score, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.score, self.step = float(state["score"]), int(state["step"])  # (saved as a tensor, say: a float)


class Kept(NamedTuple):
    score: float
    step: int


class BestCheckpoints:
    """``--keep-best K``: which steps' checkpoints (best-stepN.pt) to keep, the K best by ``best``'s order."""

    def __init__(self, k: int, best: BestScore):
        self.k, self.best, self.kept = k, best, []

    def update(self, score: float, step: int) -> tuple[bool, list[int]]:
        """(whether to save this step's checkpoint, the steps whose checkpoints to delete)."""
        ranked = sorted([*self.kept, Kept(score, step)], key=lambda kept: -kept.score if self.best.higher_is_better
                        else kept.score)
        self.kept, dropped = ranked[: self.k], ranked[self.k :]
        return Kept(score, step) in self.kept, [kept.step for kept in dropped]

    def state_dict(self) -> dict:
        return {"kept": [list(kept) for kept in self.kept]}

    def load_state_dict(self, state: dict) -> None:
        self.kept = [Kept(*kept) for kept in state["kept"]]


class EarlyStopping:
    """``--patience N``: stop after N evaluations in a row without a better score."""

    def __init__(self, evaluations: int):
        self.evaluations, self.since_best = evaluations, 0

    def exhausted(self, improved: bool) -> bool:
        self.since_best = 0 if improved else self.since_best + 1
        return self.stopped

    @property
    def stopped(self) -> bool:
        """Whether the evaluations so far used the patience up (also in a run resumed after its early stop)."""
        return self.since_best >= self.evaluations

    def state_dict(self) -> dict:
        return {"since_best": self.since_best}

    def load_state_dict(self, state: dict) -> None:
        self.since_best = state["since_best"]
