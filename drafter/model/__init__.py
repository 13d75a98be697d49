"""The drafter library's model: the drafter network: its config, the Llama and MLA draft layers, TTT attention
(blockwise on the CPU, flex on a GPU), RoPE, the vocab maps, the target it reads.
"""
