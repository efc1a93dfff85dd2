"""Scheduling: per layer step, what must be resident, what is missing and in which order it is loaded;
the copy engine's time model and next-layer prefetch.

Nothing is imported here: import the modules themselves.
"""
