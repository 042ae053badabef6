"""Leaf helpers with no gograph import: ``_torch`` (torch's private calls, in one place) and
``_warn`` (warnings attributed to the user's line)."""
