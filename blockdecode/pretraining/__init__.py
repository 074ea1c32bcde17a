"""The built-in models' recipes in code: base models from scratch on the standard library (`corpus`,
`pretrain`), and the English-Spanish Marian on Bible verse pairs (`bible`, `translation`)."""
