"""Text in and out: tokenizer loading, tokenization and incremental detokenization."""
