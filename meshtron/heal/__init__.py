"""Keeping training alive through the loss of ranks and nodes (issue 22)."""
