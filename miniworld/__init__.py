"""The mini world: tiny K2-style and K2.5-style targets, a tokenizer and a "public" drafter."""
