"""Decoding: the predict-verify-accept loop (`loop`), what it returns (`output`), its plan (`plan`), the seam to
the model (`adapter`), the generation config's rules, acceptance rules, speculative sampling, token healing, the
ranked trees (`ranking`), calibration and clocks, and `transformers`' own greedy as the reference."""
