"""Data: corpora, tokenizers and the token streams the DataModules serve."""
