"""The `plugserve` command line."""
