"""The host CPU as a second executor: the worker that computes offloaded experts, and the user's cpu= knob.

Nothing is imported here: import the modules themselves.
"""
