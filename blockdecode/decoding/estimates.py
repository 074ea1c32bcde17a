"""What a candidate's chance to stand is believed to be: its source's prior (the drafter's own, or the rate shipped
beside the model), moved by this sequence's outcomes, a Beta posterior per drafter and key."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from blockdecode.core.hf import same_weights
from blockdecode.core.io import read_json
from blockdecode.drafters.proposals import LOOP_PRIOR, PADDING_PRIOR, Source, _confidence_source

DECAY = 0.93  # every call, past outcomes count this much less: a drafter dropped for a while is tried again
PRIOR_WEIGHT = 4.0  # trials a prior counts for: a few dozen calls of outcomes outweigh it


def source_name(drafter: str, key: tuple) -> str:
    """A source's name in a priors file: "heads confidence 3", "ngram match 2"."""
    return " ".join(map(str, (drafter, *key)))


PRIORS = "ranking.json"  # beside a saved model: its drafters' acceptance rates, by source


def shipped_rates(folder: str | Path | None, signature: list[float]) -> dict[str, float]:
    """The acceptance rates saved beside a model (`calibrate.record_rates`) if they are for these weights
    (`hf.weights_signature`); none otherwise. A damaged file is one line on stderr, then ignored: the
    drafters' own priors serve, and the sequence teaches the rest."""
    path = Path(folder) / PRIORS if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        saved = read_json(path)
        rates = saved.get("rates") if isinstance(saved, dict) else None
        if not isinstance(rates, dict) or not all(isinstance(v, float) and 0 <= v <= 1 for v in rates.values()):
            raise ValueError(f"{path} holds no acceptance rates between 0 and 1")
    except ValueError as err:
        print(f"blockdecode: {err}; ranking from the drafters' own priors", file=sys.stderr)
        return {}
    found = saved.get("signature")
    return rates if isinstance(found, list) and same_weights(found, signature) else {}


def own_prior(drafter: str, key: tuple) -> float:
    """The prior the drafters here give a source of this key: a confidence bin's middle (half that
    aside), `PADDING_PRIOR` for a chain's padding, `LOOP_PRIOR` for a loop gone on past the present, an even chance
    otherwise."""
    if key[0] == "confidence":
        return _confidence_source(drafter, key[1], len(key) > 2).prior
    return {"padding": PADDING_PRIOR, "loop": LOOP_PRIOR}.get(key[0], 0.5)


class Estimates:
    """Per (drafter, key), hits and trials of this sequence on top of the prior (a Beta posterior
    whose prior counts `PRIOR_WEIGHT` trials): the rate shipped with the model for that source if
    `rates` holds it, else the drafter's own prior."""

    def __init__(self, rates: Mapping[str, float] | None = None, decay: float = DECAY) -> None:
        self.counts: dict[tuple[str, tuple], list[float]] = {}
        self.rates = dict(rates or {})
        self.decay = decay

    def prior(self, source: Source) -> float:
        return self.rates.get(source_name(source.drafter, source.key), source.prior)

    def chance(self, source: Source) -> float:
        hits, trials = self.counts.get((source.drafter, source.key), (0.0, 0.0))
        return (self.prior(source) * PRIOR_WEIGHT + hits) / (PRIOR_WEIGHT + trials)

    def update(self, source: Source, stood: float) -> None:
        """One trial of `source`: 1 if it stood, 0 if not, or its chance to have stood where known."""
        counts = self.counts.setdefault((source.drafter, source.key), [0.0, 0.0])
        counts[0] += stood
        counts[1] += 1

    def forget(self) -> None:
        """Every outcome so far counts DECAY as much: estimates follow a sequence whose text changes,
        and one whose nodes were dropped drifts back to its prior, to be tried again."""
        for counts in self.counts.values():
            counts[0] *= self.decay
            counts[1] *= self.decay

    def believed(self) -> dict[str, float]:
        """Each tried source's chance as this sequence leaves it, by `source_name`: where the model's next sequence
        starts from (`Ranking.keep`), so that a source that seldom stood in its last text is not offered at its
        prior again (in open chat, a lookup's first token at 0.5 where a tenth stands)."""
        return {
            source_name(*k): (self.rates.get(source_name(*k), own_prior(*k)) * PRIOR_WEIGHT + h) / (PRIOR_WEIGHT + t)
            for k, (h, t) in sorted(self.counts.items())
            if t > 0
        }

    def rates_seen(self, least: float = 5.0) -> dict[str, float]:
        """The hit rate of every source with at least `least` trials, by `source_name`."""
        return {source_name(*k): h / t for k, (h, t) in sorted(self.counts.items()) if t >= least}
