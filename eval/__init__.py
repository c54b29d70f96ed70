"""Retrieval metrics and evaluation reports (plain library)."""
