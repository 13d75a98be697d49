"""The drafter library's train: training: the TTT loss, the GPU path's step and fused loss, the DeepSpeed loop."""
