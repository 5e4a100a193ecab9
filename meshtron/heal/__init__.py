"""Keep training through failures: elastic world sizes with re-planning (elastic.py)."""
