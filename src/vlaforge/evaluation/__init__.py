"""Closed-loop evaluation of trained policies."""
