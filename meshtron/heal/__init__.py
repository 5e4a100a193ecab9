"""Keep training through failures: elastic world sizes, in-memory snapshots, replica fault tolerance."""
