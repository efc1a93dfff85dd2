"""Integration with transformers: finding MoE layers, the drop-in for v5 experts modules and per-expert
blocks, and reading checkpoints one tensor at a time.

Nothing is imported here: import the modules themselves.
"""
