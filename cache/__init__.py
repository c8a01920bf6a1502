"""The embedding cache (a later issue)."""
