"""Training: the built-in model's corpus, tokenizer and weights, and DFLASH drafts for any
supported target (``flashsplit train-draft``). docs/training.md describes the pipeline."""
