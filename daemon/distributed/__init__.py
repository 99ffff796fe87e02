"""A pipeline across ranks on MLX's own distributed engine (mx.distributed ring or JACCL).

mlx-lm's PipelineMixin splits the decoder layers and moves the activations; each rank keeps its
layers' non-expert weights resident and streams only its own layers' experts. Rank 0 is the
daemon: it owns the socket and the scheduler, and broadcasts each step for the others to follow.
"""
