"""Planning: which width each routed expert runs at (the CRISP plan, its combination statistics, the
equal-bytes baselines, serving policies and the default serving choice). Pure Python, no tensors on a device.

Nothing is imported here: import the modules themselves.
"""
