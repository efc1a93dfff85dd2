"""Residency: which expert prefixes are on the device (the byte-budget ledger, eviction policies, the
device prefix cache and the host store of packed experts).

Nothing is imported here: import the modules themselves.
"""
