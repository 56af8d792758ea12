"""Model files on disk: what they are and what serving them takes."""
