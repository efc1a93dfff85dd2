"""Files: the CRISP pack (packed experts, description, plan, stored serving choices) and atomic outputs.

Nothing is imported here: import the modules themselves.
"""
