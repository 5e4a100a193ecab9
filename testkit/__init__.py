"""Test helpers: multi-process gloo harness (`multiproc`) and parallel-vs-single equivalence runs."""
