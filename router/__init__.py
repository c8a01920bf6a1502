"""The OpenAI-compatible router (a later issue)."""
