"""The drafter library's data: hidden-state datasets: prompts, capture, the dataset files, packing, regeneration, two
captures held to each other.
"""
