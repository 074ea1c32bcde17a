"""The plumbing every layer stands on: files kept whole (`io`), what blockdecode must know of a `transformers`
model (`hf`), the machine (`hardware`), candidate trees (`tree`), the chunked cross-entropy (`loss`), figures
(`plots`) and random test models (`toy`). Nothing here knows about drafting or decoding."""
