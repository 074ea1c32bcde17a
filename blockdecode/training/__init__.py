"""Training drafters on a base: the one resumable loop (`loop`), a run's settings (`config`), data, distilled
targets, cached features, the heads' objective, and the heads' and the EAGLE-3 drafter's runs."""
