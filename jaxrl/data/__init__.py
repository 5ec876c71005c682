"""Prompt sources and built-in tasks."""
