"""Evaluation evidence: each evaluation kept whole, signed, and bound to what it was measured on.

An evaluate run carries `evidence.json`: the per-class, per-prompt cycle counts that accept_len and its
interval are computed from, the prompts' identities, the digest of every file the engine loaded, the
profile's values, the target, the engine. It is signed (registry.ledger.signing) by the evaluating process,
so a person with registry access can read evidence but cannot write it. A decision verifies the signature
before reading anything else, checks the counts are physically possible, and recomputes every figure: tags
are pointers for the UI, never evidence. Three modules: `record` (what a record holds and how evaluate logs
it), `verify` (which runs are evidence and which records count) and `recompute` (what the promotion rule
reads, recomputed from them).
"""
