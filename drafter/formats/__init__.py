"""The drafter library's formats: the files a drafter ships as: checkpoints, the layouts public drafters use, the
speculators format, what an aux layer id means to each engine.
"""
