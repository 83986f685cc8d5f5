"""Helpers every part of the package uses: dtypes, casting inside collections, optional imports, torch version
checks."""
