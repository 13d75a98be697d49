"""The integrity ledger: who signs what (keys, trust), signed evidence and sanctions, the chain of sanctions and who
writes its next link, lineage, audit lines, reconciliation, the guard, the promotion rule, recertification, the
bake-off's records and the watch's.
"""
