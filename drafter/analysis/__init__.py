"""The drafter library's analysis: what is worked out about a drafter without training it: the shape gate's rules, the
transfer probe, fingerprints and sketches, the memory plan, the draft-step cost.
"""
