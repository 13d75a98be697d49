"""The drafter library's decode: speculative decoding and the in-process acceptance measurement."""
