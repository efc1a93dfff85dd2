"""Execution: issuing a layer step (copies and kernels in the scheduler's order), the all-resident
compiled path, and the counters a run reports.

Nothing is imported here: import the modules themselves.
"""
